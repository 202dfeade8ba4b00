// cpp_refit_guard.cpp - a serving / RL-trainer flow through bindings/cpp/dsv4.hpp (C++17).
// Built twice by tests/c_programs.rs: plain (methods return dsv4_status) and with
// -DDSV4_HPP_EXCEPTIONS (failures throw dsv4::Error).
//
//   cpp_refit_guard [CONFIG(tiny|dir) [LOAD(dummy|checkpoint)]]
//
// create -> load -> finalize on the CPU backend; version and weight queries; prefill two
// sequences and greedy-decode a few steps into one reused logits buffer; a too-small
// caller buffer is rejected without running; a BatchView forward matches the HostBatch
// one; the log callback receives the library's INFO line for an ignored mtp.* refit entry
// and stops receiving when replaced / cleared; chunked refits through dsv4::RefitSession:
// left by an exception (exceptions build) or an early return (status build), the engine is
// READY again with the chunk written before the failure applied (read back through
// dsv4_weight_info's data pointer and seen in the logits); a complete refit with end();
// restoring the original weights gives the original logits and the same greedy tokens;
// on a QUANTIZE engine, an FP8 half held without its scale makes end() fail (refit still
// open) and is dropped when the guard aborts, and is written once its scale follows.
#include "cpp_test_support.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

/// Status of `f()`, whether the wrapper returns it or throws it.
template <class F> static dsv4_status status_of(F &&f) {
#if defined(DSV4_HPP_EXCEPTIONS)
    try {
        return f();
    } catch (const dsv4::Error &e) {
        return e.status();
    }
#else
    return f();
#endif
}

static float bf16_to_f32(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static float f16_to_f32(uint16_t h) {
    const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) {
        v = std::ldexp(static_cast<float>(man), -24);
    } else if (exp == 31) {
        v = man != 0 ? NAN : INFINITY;
    } else {
        v = std::ldexp(static_cast<float>(man | 0x400), exp - 25);
    }
    return sign != 0 ? -v : v;
}

/// The engine's current value of weight `name`, read through its storage pointer (CPU).
static std::vector<float> read_weight(const dsv4::Engine &e, const std::string &name) {
    dsv4::WeightInfo w;
    std::vector<float> out;
    if (status_of([&] { return e.find_weight(name, w); }) != DSV4_STATUS_OK || w.data == nullptr ||
        w.device != DSV4_DEVICE_CPU) {
        return out;
    }
    const std::size_t n = static_cast<std::size_t>(w.numel());
    out.resize(n);
    const unsigned char *p = static_cast<const unsigned char *>(w.data);
    for (std::size_t k = 0; k < n; ++k) {
        if (w.dtype == DSV4_DTYPE_F32 && w.nbytes >= 4 * n) {
            std::memcpy(&out[k], p + 4 * k, 4);
        } else if ((w.dtype == DSV4_DTYPE_BF16 || w.dtype == DSV4_DTYPE_F16) && w.nbytes >= 2 * n) {
            uint16_t h;
            std::memcpy(&h, p + 2 * k, 2);
            out[k] = w.dtype == DSV4_DTYPE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        } else {
            out.clear();
            return out;
        }
    }
    return out;
}

static std::size_t argmax(const float *row, std::size_t n) {
    std::size_t best = 0;
    for (std::size_t k = 1; k < n; ++k) {
        if (row[k] > row[best]) {
            best = k;
        }
    }
    return best;
}

static float max_abs_diff(const std::vector<float> &a, const std::vector<float> &b) {
    if (a.size() != b.size()) {
        return INFINITY;
    }
    float d = 0.0f;
    for (std::size_t k = 0; k < a.size(); ++k) {
        const float x = std::fabs(a[k] - b[k]);
        d = (x > d || std::isnan(x)) ? x : d;
    }
    return d;
}

/// Messages received by a test sink (the callback may run on worker threads).
struct Captured {
    std::mutex mu;
    std::vector<std::pair<int32_t, std::string>> lines;
    std::size_t count() {
        std::lock_guard<std::mutex> l(mu);
        return lines.size();
    }
    bool has(int32_t level, const char *needle) {
        std::lock_guard<std::mutex> l(mu);
        for (const auto &m : lines) {
            if (m.first == level && m.second.find(needle) != std::string::npos) {
                return true;
            }
        }
        return false;
    }
    dsv4::LogFn sink() {
        return [this](int32_t level, std::string_view message) {
            std::lock_guard<std::mutex> l(mu);
            lines.emplace_back(level, std::string(message));
        };
    }
};

/// Prefill of slot 0 = {1,2,3,4} and slot 1 = {5,6} from position 0 (restarting both
/// sequences), last-row logits: the probe of the weights in effect.
static std::vector<float> probe(dsv4::Engine &e) {
    dsv4::HostBatch b;
    b.all_rows = false;
    b.add_sequence(0, 0, {1, 2, 3, 4});
    b.add_sequence(1, 0, {5, 6});
    std::vector<float> logits;
    if (e.forward(b, logits) != DSV4_STATUS_OK) {
        logits.clear();
    }
    return logits;
}

/// Prefill (as probe) then `steps` greedy decode steps of both sequences, all into one
/// reused logits vector. Returns the generated tokens (slot 0, slot 1 interleaved).
static std::vector<int32_t> greedy(dsv4::Engine &e, int steps, bool check_reuse) {
    const std::size_t vocab = static_cast<std::size_t>(e.vocab_size());
    std::vector<int32_t> out;
    dsv4::HostBatch b;
    b.all_rows = false;
    b.add_sequence(0, 0, {1, 2, 3, 4});
    b.add_sequence(1, 0, {5, 6});
    std::vector<float> logits;
    logits.reserve(e.max_logits_floats());
    const float *buffer = logits.data();
    EXPECT(e.forward(b, logits) == DSV4_STATUS_OK, "prefill of two sequences");
    EXPECT(logits.size() == 2 * vocab, "prefill logits: 2 rows x vocab");
    int32_t len0 = -1, len1 = -1;
    EXPECT(e.slot_length(0, len0) == DSV4_STATUS_OK && e.slot_length(1, len1) == DSV4_STATUS_OK && len0 == 4 &&
               len1 == 2,
           "slot lengths after the prefill");
    std::string canonical;
    int32_t kind = -1;
    EXPECT(e.canonical_name("model.layers.0.self_attn.q_a_proj.weight", canonical, kind) == DSV4_STATUS_OK &&
               canonical == "layers.0.attn.wq_a.weight" && kind == DSV4_NAME_WEIGHT,
           "canonical name of an HF-native name");
    int32_t pos[2] = {4, 2};
    for (int step = 0; step < steps; ++step) {
        const int32_t t0 = static_cast<int32_t>(argmax(logits.data(), vocab));
        const int32_t t1 = static_cast<int32_t>(argmax(logits.data() + vocab, vocab));
        out.push_back(t0);
        out.push_back(t1);
        b.clear();
        b.add_sequence(0, pos[0]++, {t0});
        b.add_sequence(1, pos[1]++, {t1});
        EXPECT(e.forward(b, logits) == DSV4_STATUS_OK, "decode step");
        EXPECT(logits.size() == 2 * vocab, "decode logits: 2 rows x vocab");
        if (check_reuse) {
            EXPECT(logits.data() == buffer, "the caller's logits buffer is reused, not reallocated");
        }
        bool finite = true;
        for (float v : logits) {
            finite = finite && std::isfinite(v);
        }
        EXPECT(finite, "finite decode logits");
    }
    return out;
}

/// Stored-format halves on a QUANTIZE engine (FP8 storage): FP8 codes sent without their
/// scale are held; end() is then TENSOR and leaves the refit open; leaving the guard's scope
/// drops the held half (the weight keeps its bytes) and the engine is READY. Sent with its
/// scale in a later chunk, end() writes it.
static void held_halves(dsv4_create_params p, const std::string &load) {
    p.weight_format = DSV4_WEIGHT_FORMAT_QUANTIZE;
    dsv4::Engine e;
    EXPECT(dsv4::Engine::create(p, e) == DSV4_STATUS_OK, "create (QUANTIZE)");
    EXPECT((load == "dummy" ? e.load_dummy() : e.load(load)) == DSV4_STATUS_OK, "load (QUANTIZE)");
    EXPECT(e.finalize() == DSV4_STATUS_OK, "finalize (QUANTIZE)");
    const std::string name = "layers.0.attn.wq_a.weight", scale_name = name + "_scale_inv";
    dsv4::WeightInfo w;
    EXPECT(e.find_weight(name, w) == DSV4_STATUS_OK && w.dtype == DSV4_DTYPE_F8_E4M3 && w.shape.size() == 2 &&
               w.scale != nullptr && w.scale_block[0] > 0 && w.scale_block[1] > 0,
           "an FP8 weight with block scales");
    if (w.dtype != DSV4_DTYPE_F8_E4M3 || w.shape.size() != 2 || w.scale == nullptr || w.scale_block[0] <= 0) {
        return;
    }
    const unsigned char *data = static_cast<const unsigned char *>(w.data);
    const std::vector<unsigned char> before(data, data + w.nbytes);
    const std::vector<unsigned char> codes(w.nbytes, 0x38); // e4m3 1.0 everywhere
    EXPECT(codes != before, "new codes differ");
    const std::vector<float> scale(static_cast<const float *>(w.scale),
                                   static_cast<const float *>(w.scale) + w.scale_nbytes / 4);
    const int64_t grid_r = (w.shape[0] + w.scale_block[0] - 1) / w.scale_block[0];
    const int64_t grid_c = (w.shape[1] + w.scale_block[1] - 1) / w.scale_block[1];
    EXPECT(static_cast<std::size_t>(grid_r * grid_c) == scale.size(), "scale grid");
    const dsv4_tensor t_codes = dsv4::make_tensor(name.c_str(), DSV4_DTYPE_F8_E4M3, w.shape, codes.data());
    const dsv4_tensor t_scale =
        dsv4::make_tensor(scale_name.c_str(), DSV4_DTYPE_F32, {grid_r, grid_c}, scale.data());

    bool left = false;
#if defined(DSV4_HPP_EXCEPTIONS)
    try {
        auto g = e.refit_session();
        g.refit({t_codes}); // held until its scale comes
        g.end();            // throws TENSOR: the scale is missing
    } catch (const dsv4::Error &err) {
        left = err.status() == DSV4_STATUS_TENSOR;
    }
#else
    auto scope = [&]() -> dsv4_status {
        auto g = e.refit_session();
        dsv4_status s = g.refit({t_codes});
        if (s != DSV4_STATUS_OK) {
            return s;
        }
        s = g.end();
        EXPECT(g.is_open() && e.phase() == DSV4_PHASE_REFITTING, "a failed end() leaves the refit open");
        return s;
    };
    left = scope() == DSV4_STATUS_TENSOR;
#endif
    EXPECT(left, "end() with a held half: TENSOR");
    EXPECT(e.phase() == DSV4_PHASE_READY, "READY after the guard aborted");
    EXPECT(std::memcmp(data, before.data(), before.size()) == 0, "the held half was dropped, never written");

    {
        auto g = e.refit_session();
        EXPECT(g.refit({t_codes}) == DSV4_STATUS_OK, "codes (held)");
        EXPECT(g.refit({t_scale}) == DSV4_STATUS_OK, "scale in a later chunk");
        EXPECT(g.end() == DSV4_STATUS_OK, "end() with the pair complete");
    }
    EXPECT(e.phase() == DSV4_PHASE_READY, "READY");
    EXPECT(std::memcmp(data, codes.data(), codes.size()) == 0, "the pair was written");
}

static int run(const std::string &config, const std::string &load) {
    // Versions.
    EXPECT(dsv4::abi_compatible(), "ABI compatible");
    EXPECT(dsv4::abi_major() == DSV4_ABI_VERSION_MAJOR, "abi_major");
    EXPECT(dsv4::abi_minor() >= 3u && dsv4::abi_minor() >= DSV4_ABI_VERSION_MINOR, "abi_minor >= 1.3");
    EXPECT(dsv4::header_abi_version() == ((1u << 16) | DSV4_ABI_VERSION_MINOR), "header_abi_version");
    EXPECT(dsv4::version_string().find("dsv4") != std::string::npos, "version_string");

    // Log sink installed before create: whatever create / load / finalize log lands here.
    Captured logs;
    EXPECT(dsv4::set_log_callback(logs.sink(), DSV4_LOG_DEBUG) == DSV4_STATUS_OK, "install log callback");

    dsv4_create_params p = test_params(config);
#if defined(DSV4_HPP_EXCEPTIONS)
    dsv4::Engine engine(p);
#else
    dsv4::Engine engine;
    EXPECT(dsv4::Engine::create(p, engine) == DSV4_STATUS_OK, "create");
#endif
    EXPECT(engine.phase() == DSV4_PHASE_CREATED, "phase CREATED");
    EXPECT(engine.cached_info().vocab_size > 0, "info cached at create");
    if (load == "dummy") {
        EXPECT(engine.load_dummy() == DSV4_STATUS_OK, "load dummy");
    } else {
        EXPECT(engine.load(load) == DSV4_STATUS_OK, "load checkpoint");
    }
    EXPECT(engine.finalize() == DSV4_STATUS_OK, "finalize");
    const std::size_t during_setup = logs.count();

    // Info and weights.
    const dsv4_info info = engine.info();
    EXPECT(info.phase == DSV4_PHASE_READY && engine.phase() == DSV4_PHASE_READY, "phase READY");
    EXPECT(info.vocab_size == engine.vocab_size() && info.vocab_size > 0, "cached vocab_size");
    EXPECT(info.max_num_tokens == 16 && info.max_num_seqs == 2 && info.device == DSV4_DEVICE_CPU, "capacities");
    EXPECT(engine.max_logits_floats() == 16u * static_cast<std::size_t>(info.vocab_size), "max_logits_floats");
    const std::size_t vocab = static_cast<std::size_t>(info.vocab_size);
    std::size_t count = 0;
    EXPECT(engine.weight_count(count) == DSV4_STATUS_OK && count == info.num_weights, "weight_count");
    const std::vector<dsv4::WeightInfo> all = engine.weights();
    EXPECT(all.size() == count && count > 0, "weights()");
    std::size_t derived = 0;
    bool names_ok = true;
    for (std::size_t i = 0; i < all.size(); ++i) {
        names_ok = names_ok && !all[i].name.empty() && all[i].index == i && all[i].data != nullptr &&
                   all[i].nbytes > 0 && static_cast<int32_t>(all[i].shape.size()) <= DSV4_MAX_DIMS;
        derived += all[i].derived ? 1 : 0;
    }
    EXPECT(names_ok, "every weight has a name, an index, storage");
    EXPECT(derived > 0 && derived < count, "sources and derived tensors");
    dsv4::WeightInfo norm;
    EXPECT(engine.find_weight("norm.weight", norm) == DSV4_STATUS_OK && !norm.derived && norm.shape.size() == 1 &&
               norm.data == all[norm.index].data,
           "find_weight(norm.weight)");
    EXPECT(status_of([&] { return engine.find_weight("no.such.weight", norm); }) == DSV4_STATUS_TENSOR &&
               dsv4::last_error().find("no.such.weight") != std::string::npos,
           "find_weight of an unknown name: TENSOR, named");

    // Prefill two sequences + greedy decode into one reused buffer.
    const std::vector<float> baseline = probe(engine);
    EXPECT(baseline.size() == 2 * vocab, "probe logits");
    const std::vector<int32_t> tokens = greedy(engine, 4, true);
    std::printf("greedy tokens:");
    for (int32_t t : tokens) {
        std::printf(" %d", t);
    }
    std::printf("\nlogit0 = %.6f\n", static_cast<double>(baseline[0]));

    // A caller buffer one float too small: rejected before running (no overflow, no state
    // change: the same continuing batch then runs with a big enough buffer).
    {
        dsv4::HostBatch b;
        b.all_rows = false;
        b.add_sequence(0, 0, {1, 2, 3, 4});
        b.add_sequence(1, 0, {5, 6});
        std::vector<float> big;
        EXPECT(engine.forward(b, big) == DSV4_STATUS_OK, "restart both sequences");
        b.clear();
        b.add_sequence(0, 4, {7});
        b.add_sequence(1, 2, {8});
        std::vector<float> small(2 * vocab + 64, 7.0f);
        EXPECT(status_of([&] { return engine.forward(b, small.data(), 2 * vocab - 1); }) ==
                   DSV4_STATUS_INVALID_ARGUMENT,
               "too-small logits buffer: INVALID_ARGUMENT");
        EXPECT(dsv4::last_error().find("too small") != std::string::npos, "message says too small");
        bool untouched = true;
        for (float v : small) {
            untouched = untouched && v == 7.0f;
        }
        EXPECT(untouched, "nothing written into the too-small buffer");
        EXPECT(engine.forward(b, small.data(), small.size()) == DSV4_STATUS_OK,
               "the same continuing batch runs: the rejected call changed no slot");
        bool tail = true;
        for (std::size_t k = 2 * vocab; k < small.size(); ++k) {
            tail = tail && small[k] == 7.0f;
        }
        EXPECT(tail && small[0] != 7.0f, "exactly 2 x vocab floats written");
    }

    // BatchView (the device-pointer forward; host pointers on the CPU backend).
    {
        const int32_t ids[] = {1, 2, 3, 4, 5, 6}, pos[] = {0, 1, 2, 3, 0, 1}, slots[] = {0, 1},
                      qs[] = {0, 4, 6}, rows[] = {3, 5};
        std::vector<float> out(2 * vocab, -1.0f);
        dsv4::BatchView v;
        v.num_tokens = 6;
        v.num_seqs = 2;
        v.token_ids = ids;
        v.positions = pos;
        v.seq_slots = slots;
        v.query_start = qs;
        v.logits_rows = rows;
        v.num_logits = 2;
        v.logits = out.data();
        EXPECT(engine.forward(v) == DSV4_STATUS_OK, "BatchView forward");
        EXPECT(max_abs_diff(out, baseline) == 0.0f, "BatchView logits == HostBatch logits");
    }

    // Log callback: an mtp.* refit entry is ignored with an INFO line.
    const float one = 1.0f;
    const dsv4_tensor mtp = dsv4::make_tensor("mtp.0.norm.weight", DSV4_DTYPE_F32, {1}, &one);
    {
        const std::size_t before = logs.count();
        EXPECT(engine.refit(&mtp, 1) == DSV4_STATUS_OK, "refit of an mtp.* entry (ignored)");
        EXPECT(logs.count() > before && logs.has(DSV4_LOG_INFO, "mtp"), "log callback received the INFO line");
        std::printf("log lines: %zu during create/load/finalize, %zu now\n", during_setup, logs.count());

        Captured second;
        EXPECT(dsv4::set_log_callback(second.sink(), DSV4_LOG_WARN) == DSV4_STATUS_OK, "replace at WARN");
        const std::size_t first_n = logs.count();
        EXPECT(engine.refit(&mtp, 1) == DSV4_STATUS_OK, "mtp refit");
        EXPECT(logs.count() == first_n, "the replaced callback receives nothing");
        EXPECT(second.count() == 0, "INFO filtered at WARN");
        EXPECT(status_of([&] { return dsv4::set_log_callback(logs.sink(), 42); }) == DSV4_STATUS_INVALID_ARGUMENT,
               "bad max_level rejected");
        EXPECT(dsv4::set_log_callback(second.sink(), DSV4_LOG_INFO) == DSV4_STATUS_OK, "second at INFO");
        EXPECT(engine.refit(&mtp, 1) == DSV4_STATUS_OK, "mtp refit");
        EXPECT(second.has(DSV4_LOG_INFO, "mtp") && logs.count() == first_n, "only the installed callback receives");
        const std::size_t second_n = second.count();
        EXPECT(dsv4::set_log_callback([](int32_t, std::string_view) { throw std::runtime_error("sink"); },
                                      DSV4_LOG_INFO) == DSV4_STATUS_OK,
               "a throwing callback");
        EXPECT(engine.refit(&mtp, 1) == DSV4_STATUS_OK, "an exception in the callback is contained");
        EXPECT(dsv4::clear_log_callback() == DSV4_STATUS_OK, "clear_log_callback");
        EXPECT(engine.refit(&mtp, 1) == DSV4_STATUS_OK, "mtp refit after clear");
        EXPECT(second.count() == second_n && logs.count() == first_n, "no callback after clear");
        EXPECT(dsv4::set_log_callback(logs.sink(), DSV4_LOG_DEBUG) == DSV4_STATUS_OK, "reinstall");
    }

    // Chunked refits through the guard.
    const std::string w1 = "norm.weight", w2 = "layers.0.attn_norm.weight";
    const std::vector<float> orig1 = read_weight(engine, w1), orig2 = read_weight(engine, w2);
    EXPECT(!orig1.empty() && !orig2.empty(), "read the weights back through their storage pointers");
    auto changed = [](const std::vector<float> &v) {
        std::vector<float> r(v);
        for (float &x : r) {
            x = x == 0.0f ? 1.0f : 2.0f * x; // exact in F32 / BF16 / F16 storage
        }
        return r;
    };
    const std::vector<float> new1 = changed(orig1), new2 = changed(orig2);
    const std::vector<int64_t> shape1{static_cast<int64_t>(orig1.size())}, shape2{static_cast<int64_t>(orig2.size())};
    const dsv4_tensor t_new1 = dsv4::make_tensor(w1.c_str(), DSV4_DTYPE_F32, shape1, new1.data());
    const dsv4_tensor t_new2 = dsv4::make_tensor(w2.c_str(), DSV4_DTYPE_F32, shape2, new2.data());
    const dsv4_tensor t_orig1 = dsv4::make_tensor(w1.c_str(), DSV4_DTYPE_F32, shape1, orig1.data());
    const dsv4_tensor t_orig2 = dsv4::make_tensor(w2.c_str(), DSV4_DTYPE_F32, shape2, orig2.data());
    const dsv4_tensor t_bad = dsv4::make_tensor("layers.0.no_such.weight", DSV4_DTYPE_F32, {1}, &one);

    // 1. A chunk, then a failing chunk: the scope is left with the refit open.
    {
        bool left_by_failure = false;
#if defined(DSV4_HPP_EXCEPTIONS)
        try {
            auto g = engine.refit_session();
            EXPECT(g.is_open() && engine.phase() == DSV4_PHASE_REFITTING, "session open: REFITTING");
            dsv4::HostBatch b;
            b.add_sequence(0, 0, {1});
            EXPECT(status_of([&] { return engine.forward(b); }) == DSV4_STATUS_STATE, "no forward during a refit");
            g.refit({t_new1});
            g.refit({t_bad}); // throws dsv4::Error(TENSOR)
            EXPECT(false, "unreachable: the bad chunk throws");
        } catch (const dsv4::Error &e) {
            left_by_failure = e.status() == DSV4_STATUS_TENSOR && e.message().find("no_such") != std::string::npos;
        }
#else
        auto scope = [&]() -> dsv4_status {
            auto g = engine.refit_session();
            if (!g) {
                return g.begin_status();
            }
            EXPECT(engine.phase() == DSV4_PHASE_REFITTING, "session open: REFITTING");
            dsv4::HostBatch b;
            b.add_sequence(0, 0, {1});
            EXPECT(engine.forward(b) == DSV4_STATUS_STATE, "no forward during a refit");
            dsv4_status s = g.refit({t_new1});
            if (s != DSV4_STATUS_OK) {
                return s;
            }
            s = g.refit({t_bad});
            if (s != DSV4_STATUS_OK) {
                return s; // early return without end(): the destructor aborts
            }
            return g.end();
        };
        left_by_failure = scope() == DSV4_STATUS_TENSOR &&
                          dsv4::last_error().find("no_such") != std::string::npos; // kept past the abort
#endif
        EXPECT(left_by_failure, "the bad chunk failed with TENSOR naming it");
        EXPECT(engine.info().phase == DSV4_PHASE_READY, "READY after the guard aborted");
        EXPECT(read_weight(engine, w1) == new1, "the chunk written before the failure is applied");
        const std::vector<float> l = probe(engine);
        EXPECT(l.size() == 2 * vocab && max_abs_diff(l, baseline) > 0.0f, "forward runs, with the new weight");
    }

    // 2. A chunk restoring the weight, then a host failure (exception / early return).
    {
        bool left = false;
#if defined(DSV4_HPP_EXCEPTIONS)
        try {
            auto g = engine.refit_session();
            g.refit({t_orig1});
            throw std::runtime_error("host failure mid-refit");
        } catch (const std::runtime_error &e) {
            left = std::string(e.what()) == "host failure mid-refit";
        }
#else
        auto scope = [&]() -> bool {
            auto g = engine.refit_session();
            if (g.refit({t_orig1}) != DSV4_STATUS_OK) {
                return false;
            }
            return true; // leaves without end()
        };
        left = scope();
#endif
        EXPECT(left, "left the guard's scope early");
        EXPECT(engine.info().phase == DSV4_PHASE_READY, "READY after the guard aborted");
        EXPECT(read_weight(engine, w1) == orig1, "the restoring chunk is applied");
        EXPECT(max_abs_diff(probe(engine), baseline) == 0.0f, "original logits again (derived buffers rebuilt)");
    }

    // 3. A complete chunked refit: two chunks, end().
    {
        auto g = engine.refit_session();
        EXPECT(g.refit({t_new1}) == DSV4_STATUS_OK, "chunk 1");
        EXPECT(g.refit({t_new2}) == DSV4_STATUS_OK, "chunk 2");
        EXPECT(g.end() == DSV4_STATUS_OK && !g.is_open(), "end()");
        EXPECT(status_of([&] { return g.end(); }) == DSV4_STATUS_STATE, "end() twice: STATE");
        EXPECT(status_of([&] { return g.refit({t_orig1}); }) == DSV4_STATUS_STATE, "refit after end(): STATE");
        EXPECT(engine.info().phase == DSV4_PHASE_READY, "READY after end()");
        EXPECT(read_weight(engine, w1) == new1 && read_weight(engine, w2) == new2, "both chunks applied");
        const std::vector<float> l = probe(engine);
        EXPECT(l.size() == 2 * vocab && max_abs_diff(l, baseline) > 0.0f, "new logits");
    }
    // The guard is movable; a second begin while one is open is STATE; explicit abort().
    {
        auto g = engine.refit_session();
        dsv4::RefitSession moved = std::move(g);
        EXPECT(moved.is_open() && !g.is_open(), "move transfers the open refit");
        EXPECT(status_of([&] { return engine.refit_session().begin_status(); }) == DSV4_STATUS_STATE,
               "begin while a refit is open: STATE");
        EXPECT(engine.phase() == DSV4_PHASE_REFITTING, "the failed begin did not close the open refit");
        EXPECT(moved.refit({t_orig2}) == DSV4_STATUS_OK, "chunk");
        EXPECT(moved.abort() == DSV4_STATUS_OK && !moved.is_open(), "abort()");
        EXPECT(engine.phase() == DSV4_PHASE_READY, "READY after abort()");
        EXPECT(read_weight(engine, w2) == orig2, "aborted refit kept its chunk");
    }
    // 4. Restore everything with a complete refit: the original logits and greedy tokens.
    {
        auto g = engine.refit_session();
        EXPECT(g.refit({t_orig1, t_orig2}) == DSV4_STATUS_OK, "restore chunk");
        EXPECT(g.end() == DSV4_STATUS_OK, "end()");
    }
    EXPECT(engine.phase() == DSV4_PHASE_READY, "READY");
    EXPECT(max_abs_diff(probe(engine), baseline) == 0.0f, "original logits after the restoring refit");
    EXPECT(greedy(engine, 4, true) == tokens, "decode again: the same greedy tokens");

    EXPECT(dsv4::clear_log_callback() == DSV4_STATUS_OK, "clear_log_callback");
    held_halves(p, load);
    return 0;
}

int main(int argc, char **argv) {
    const std::string config = argc > 1 ? argv[1] : "tiny";
    const std::string load = argc > 2 ? argv[2] : "dummy";
#if defined(DSV4_HPP_EXCEPTIONS)
    try {
        run(config, load);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "FAIL: unexpected exception: %s\n", e.what());
        failures++;
    }
#else
    run(config, load);
#endif
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("cpp_refit_guard: OK\n");
    return 0;
}

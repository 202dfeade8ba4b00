// cpp_wrapper.cpp - exercises bindings/cpp/dsv4.hpp (C++17). Built twice by
// tests/c_programs.rs: plain (methods return dsv4_status) and with -DDSV4_HPP_EXCEPTIONS
// (failures throw dsv4::Error).
//
//   cpp_wrapper [CONFIG(tiny|dir) [LOAD(dummy|checkpoint)]]
#include "cpp_test_support.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

int main(int argc, char **argv) {
    const std::string config = argc > 1 ? argv[1] : "tiny";
    const std::string load = argc > 2 ? argv[2] : "dummy";
    EXPECT(dsv4::abi_compatible(), "ABI compatible");

    dsv4_create_params p = test_params(config);

#if defined(DSV4_HPP_EXCEPTIONS)
    // Failures throw dsv4::Error carrying status and message.
    {
        dsv4_create_params bad = p;
        bad.weight_format = 17;
        bool thrown = false;
        try {
            dsv4::Engine e(bad);
        } catch (const dsv4::Error &err) {
            thrown = true;
            EXPECT(err.status() == DSV4_STATUS_INVALID_ARGUMENT, "status of the exception");
            EXPECT(err.message().find("weight_format") != std::string::npos, "message names the field");
            EXPECT(std::string(err.what()).find("INVALID_ARGUMENT") != std::string::npos, "what()");
        }
        EXPECT(thrown, "bad params throw");
    }
    dsv4::Engine engine(p);
    bool thrown = false;
    try {
        engine.finalize(); // before load: STATE
    } catch (const dsv4::Error &err) {
        thrown = err.status() == DSV4_STATUS_STATE;
    }
    EXPECT(thrown, "finalize before load throws STATE");
#else
    dsv4::Engine engine;
    EXPECT(!engine, "default Engine is empty");
    EXPECT(engine.finalize() == DSV4_STATUS_NULL_POINTER, "calls on an empty Engine report NULL");
    EXPECT(dsv4::last_error().find("engine") != std::string::npos, "message names engine");
    dsv4_create_params bad = p;
    bad.weight_format = 17;
    EXPECT(dsv4::Engine::create(bad, engine) == DSV4_STATUS_INVALID_ARGUMENT, "bad weight_format");
    EXPECT(dsv4::Engine::create(p, engine) == DSV4_STATUS_OK, "create");
    EXPECT(engine.finalize() == DSV4_STATUS_STATE, "finalize before load");
#endif

    if (load == "dummy") {
        EXPECT(engine.load_dummy() == DSV4_STATUS_OK, "load dummy");
    } else {
        EXPECT(engine.load(load) == DSV4_STATUS_OK, "load checkpoint");
    }
    EXPECT(engine.finalize() == DSV4_STATUS_OK, "finalize");

    dsv4_info info{};
    EXPECT(engine.info(info) == DSV4_STATUS_OK && info.phase == DSV4_PHASE_READY, "info");
    std::size_t n = 0;
    EXPECT(engine.weight_count(n) == DSV4_STATUS_OK && n > 0, "weight count");
    dsv4_weight_desc w{};
    EXPECT(engine.weight(0, w) == DSV4_STATUS_OK && w.name != nullptr, "weight 0");

    // Two sequences, last-row logits only.
    dsv4::HostBatch b;
    b.all_rows = false;
    b.add_sequence(0, 0, {1, 2, 3, 4});
    b.add_sequence(1, 0, {5, 6});
    EXPECT(engine.forward(b) == DSV4_STATUS_OK, "forward");
    EXPECT(b.logits.size() == 2u * static_cast<std::size_t>(info.vocab_size), "logits size");
    bool finite = true;
    for (float v : b.logits) {
        finite = finite && std::isfinite(v);
    }
    EXPECT(finite, "finite logits");
    std::printf("logit0 = %.6f\n", static_cast<double>(b.logits[0]));

    // Refit one weight with its own current value (a no-op numerically).
    std::size_t idx = 0;
    for (std::size_t i = 0; i < n; ++i) {
        dsv4_weight_desc d{};
        engine.weight(i, d);
        if (std::strcmp(d.name, "norm.weight") == 0) {
            idx = i;
            w = d;
        }
    }
    EXPECT(std::strcmp(w.name, "norm.weight") == 0, "found norm.weight");
    (void)idx;
    dsv4_tensor t = dsv4_tensor_default();
    t.name = w.name;
    t.dtype = w.dtype;
    t.ndim = w.ndim;
    for (int k = 0; k < w.ndim; ++k) {
        t.shape[k] = w.shape[k];
    }
    std::vector<unsigned char> copy(static_cast<const unsigned char *>(w.data),
                                    static_cast<const unsigned char *>(w.data) + w.nbytes);
    t.data = copy.data();
    EXPECT(engine.refit(std::vector<dsv4_tensor>{t}) == DSV4_STATUS_OK, "refit");

    // Moving transfers ownership; the moved-from Engine is empty.
    dsv4::Engine moved = std::move(engine);
    EXPECT(moved && !engine, "move");
    EXPECT(moved.release_slot(1) == DSV4_STATUS_OK, "release_slot");

    // Padding: a DSV4_PAD_SLOT sequence next to a real one gives zero logits rows.
    dsv4::HostBatch padded;
    padded.all_rows = false;
    padded.add_sequence(DSV4_PAD_SLOT, 12345, {7, 8});
    padded.add_sequence(0, 0, {9});
    EXPECT(moved.forward(padded) == DSV4_STATUS_OK, "forward with padding");
    // Rows: the padding sequence's last token, then the real one's.
    bool zeros = true, real_nonzero = false;
    for (int32_t k = 0; k < info.vocab_size; ++k) {
        zeros = zeros && padded.logits[static_cast<std::size_t>(k)] == 0.0f;
        const float r = padded.logits[static_cast<std::size_t>(info.vocab_size + k)];
        real_nonzero = real_nonzero || (std::isfinite(r) && r != 0.0f);
    }
    EXPECT(zeros, "padding rows are zeros");
    EXPECT(real_nonzero, "the real row has logits");

    // The CPU backend reports a bad batch from forward: its device record stays empty.
    dsv4_batch_fault fault{};
    fault.status = -1;
    EXPECT(moved.device_error(fault) == DSV4_STATUS_OK && fault.status == 0, "device_error on the CPU");

    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("cpp_wrapper: OK\n");
    return 0;
}

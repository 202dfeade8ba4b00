// dsv4.hpp - header-only C++17 RAII wrapper over the dsv4 C ABI (include/dsv4.h).
//
// - dsv4::Engine owns a dsv4_engine* through std::unique_ptr with a deleter calling
//   dsv4_destroy; it is movable, not copyable.
// - Error handling is the host's choice. By default every method returns the dsv4_status
//   of the C call (read dsv4::last_error() for the message). Define DSV4_HPP_EXCEPTIONS
//   before including this header to have every failing call throw dsv4::Error (status +
//   message) instead; methods then still return DSV4_STATUS_OK on success.
// - Threading and lifetimes are those of the C ABI (see dsv4.h): calls on one Engine
//   must be serialized by the host; distinct Engines are independent.
#ifndef DSV4_HPP
#define DSV4_HPP

#include "dsv4.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dsv4 {

/// Message of the most recent failed dsv4 call on this thread ("" after a success).
inline std::string last_error() {
    const char *m = dsv4_last_error();
    return m != nullptr ? std::string(m) : std::string();
}

/// "OK", "INVALID_ARGUMENT", ... for a status code.
inline const char *status_name(dsv4_status s) noexcept { return dsv4_status_name(s); }

/// True if the loaded library (ABI version `library`, default: the one loaded) can serve
/// a host built against ABI `major`.`minor` (default: this header): same major, library
/// minor >= host minor.
inline bool abi_compatible(uint32_t library = dsv4_abi_version(), uint32_t major = DSV4_ABI_VERSION_MAJOR,
                           uint32_t minor = DSV4_ABI_VERSION_MINOR) noexcept {
    return (library >> 16) == major && (library & 0xffffu) >= minor;
}

/// A failed dsv4 call: its status and dsv4_last_error() at the time of failure.
class Error : public std::runtime_error {
  public:
    Error(dsv4_status status, const std::string &message)
        : std::runtime_error(std::string(dsv4_status_name(status)) + ": " + message), status_(status),
          message_(message) {}
    dsv4_status status() const noexcept { return status_; }
    const std::string &message() const noexcept { return message_; }

  private:
    dsv4_status status_;
    std::string message_;
};

namespace detail {
/// Returns `s`, or throws dsv4::Error for a failure when DSV4_HPP_EXCEPTIONS is defined.
inline dsv4_status check(dsv4_status s) {
#if defined(DSV4_HPP_EXCEPTIONS)
    if (s != DSV4_STATUS_OK) {
        throw Error(s, last_error());
    }
#endif
    return s;
}
} // namespace detail

/// Deleter for std::unique_ptr<dsv4_engine>.
struct EngineDeleter {
    void operator()(dsv4_engine *e) const noexcept { dsv4_destroy(e); }
};
using EnginePtr = std::unique_ptr<dsv4_engine, EngineDeleter>;

/// Host-side arrays of one forward batch; view() points a dsv4_batch into them.
struct HostBatch {
    std::vector<int32_t> token_ids, positions, seq_slots, query_start{0}, logits_rows;
    bool all_rows = true;
    std::vector<float> logits;

    /// Appends one sequence: `tokens` at positions start, start+1, ... in `slot`.
    /// `want_logits`: its last token produces logits (when not all rows do).
    void add_sequence(int32_t slot, int32_t start, const std::vector<int32_t> &tokens, bool want_logits = true) {
        for (std::size_t k = 0; k < tokens.size(); ++k) {
            token_ids.push_back(tokens[k]);
            positions.push_back(start + static_cast<int32_t>(k));
        }
        seq_slots.push_back(slot);
        query_start.push_back(static_cast<int32_t>(token_ids.size()));
        if (want_logits && !tokens.empty()) {
            logits_rows.push_back(static_cast<int32_t>(token_ids.size()) - 1);
        }
    }

    /// Rows of logits view() asks for.
    std::size_t num_logits() const { return all_rows ? token_ids.size() : logits_rows.size(); }

    /// A dsv4_batch over these arrays (float32 logits, sized here for `vocab_size`).
    /// Valid until this HostBatch is modified or destroyed.
    dsv4_batch view(int32_t vocab_size) {
        logits.assign(num_logits() * static_cast<std::size_t>(vocab_size), 0.0f);
        dsv4_batch b = dsv4_batch_default();
        b.num_tokens = static_cast<int32_t>(token_ids.size());
        b.num_seqs = static_cast<int32_t>(seq_slots.size());
        b.token_ids = token_ids.data();
        b.positions = positions.data();
        b.seq_slots = seq_slots.data();
        b.query_start = query_start.data();
        b.logits_rows = all_rows ? nullptr : logits_rows.data();
        b.num_logits = static_cast<int32_t>(num_logits());
        b.logits = logits.data();
        b.logits_dtype = DSV4_LOGITS_F32;
        return b;
    }
};

/// Owns one engine. A default-constructed or moved-from Engine holds NULL; calls on it
/// return DSV4_STATUS_NULL_POINTER (or throw).
class Engine {
  public:
    Engine() noexcept = default;
    /// Adopts a handle from dsv4_create (or NULL).
    explicit Engine(dsv4_engine *raw) noexcept : ptr_(raw) {}

    /// dsv4_create into `out` (replacing what it held).
    static dsv4_status create(const dsv4_create_params &params, Engine &out) {
        dsv4_engine *raw = nullptr;
        const dsv4_status s = dsv4_create(&params, &raw);
        if (s == DSV4_STATUS_OK) {
            out.ptr_.reset(raw);
        }
        return detail::check(s);
    }

#if defined(DSV4_HPP_EXCEPTIONS)
    /// Creates the engine or throws dsv4::Error.
    explicit Engine(const dsv4_create_params &params) { create(params, *this); }
#endif

    /// dsv4_load: `source` may be nullptr for DSV4_LOAD_DUMMY.
    dsv4_status load(const char *source, int32_t format = DSV4_LOAD_AUTO) {
        return detail::check(dsv4_load(ptr_.get(), source, format));
    }
    dsv4_status load(const std::string &source, int32_t format = DSV4_LOAD_AUTO) {
        return load(source.c_str(), format);
    }
    dsv4_status load_dummy() { return load(nullptr, DSV4_LOAD_DUMMY); }
    dsv4_status load_tensor(const dsv4_tensor &t) { return detail::check(dsv4_load_tensor(ptr_.get(), &t)); }
    dsv4_status finalize(void *stream = nullptr) { return detail::check(dsv4_finalize(ptr_.get(), stream)); }
    dsv4_status forward(const dsv4_batch &b, void *stream = nullptr) {
        return detail::check(dsv4_forward(ptr_.get(), &b, stream));
    }
    /// Runs `b` with logits sized from this engine's vocabulary.
    dsv4_status forward(HostBatch &b, void *stream = nullptr) {
        dsv4_info i = info_or_zero();
        const dsv4_batch v = b.view(i.vocab_size);
        return forward(v, stream);
    }
    dsv4_status refit(const dsv4_tensor *tensors, std::size_t n, void *stream = nullptr) {
        return detail::check(dsv4_refit(ptr_.get(), tensors, n, stream));
    }
    dsv4_status refit(const std::vector<dsv4_tensor> &tensors, void *stream = nullptr) {
        return refit(tensors.data(), tensors.size(), stream);
    }
    dsv4_status release_slot(int32_t slot) { return detail::check(dsv4_release_slot(ptr_.get(), slot)); }

    /// dsv4_device_error: returns and clears the first fault of a bad batch that a CUDA
    /// engine's forwards met since the last call. Syncs `stream` (never call it inside a
    /// graph capture). DSV4_STATUS_OK with `out` zeroed when there is none (always on the
    /// CPU backend); otherwise the fault's status, `out` holding field, index, value, rule,
    /// and dsv4::last_error() the message. A fault is a report, not a failure of this call,
    /// so it never throws; a failure of the call itself (e.g. DSV4_STATUS_CUDA) does when
    /// DSV4_HPP_EXCEPTIONS is defined.
    dsv4_status device_error(dsv4_batch_fault &out, void *stream = nullptr) {
        const dsv4_status s = dsv4_device_error(ptr_.get(), stream, &out);
        if (s != DSV4_STATUS_OK && out.status != s) {
            return detail::check(s);
        }
        return s;
    }

    dsv4_status info(dsv4_info &out) const {
        out.struct_size = sizeof(dsv4_info);
        return detail::check(dsv4_get_info(ptr_.get(), &out));
    }
    dsv4_status weight_count(std::size_t &out) const { return detail::check(dsv4_weight_count(ptr_.get(), &out)); }
    dsv4_status weight(std::size_t index, dsv4_weight_desc &out) const {
        out.struct_size = sizeof(dsv4_weight_desc);
        return detail::check(dsv4_weight_info(ptr_.get(), index, &out));
    }

    dsv4_engine *get() const noexcept { return ptr_.get(); }
    /// Gives up ownership (the caller must dsv4_destroy the result).
    dsv4_engine *release() noexcept { return ptr_.release(); }
    explicit operator bool() const noexcept { return ptr_ != nullptr; }

  private:
    dsv4_info info_or_zero() const {
        dsv4_info i{};
        i.struct_size = sizeof(dsv4_info);
        if (dsv4_get_info(ptr_.get(), &i) != DSV4_STATUS_OK) {
            i.vocab_size = 0;
        }
        return i;
    }

    EnginePtr ptr_;
};

} // namespace dsv4

#endif // DSV4_HPP

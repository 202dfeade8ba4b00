// dsv4.hpp - header-only C++17 RAII wrapper over the dsv4 C ABI (include/dsv4.h).
//
// What it covers (every function of dsv4.h has a wrapper here):
//
// - Versions: dsv4::abi_version / abi_major / abi_minor / abi_compatible / version_string.
// - dsv4::Engine owns a dsv4_engine* through std::unique_ptr with a deleter calling
//   dsv4_destroy; it is movable, not copyable. create / load / load_tensor / finalize /
//   forward / refit / release_slot / device_error / info / weight queries.
// - Host forwards (dsv4::HostBatch) write into a caller-owned logits buffer that is sized
//   from the engine's cached vocabulary and reused from call to call (no reallocation once
//   its capacity suffices); a too-small caller buffer is an error, never an overflow.
// - Device forwards (dsv4::BatchView): a batch whose arrays the host already holds (CUDA
//   device pointers, e.g. the fixed buffers of a captured graph) goes to dsv4_forward on
//   the host's stream as is: nothing is copied, nothing synchronized.
// - Chunked refit (RL weight sync): Engine::refit_session returns a dsv4::RefitSession
//   guard (dsv4_refit_begin). Its destructor calls dsv4_refit_abort when neither end() nor
//   abort() closed it, so leaving the scope early - an exception, an early return - leaves
//   the engine READY with the chunks written so far applied.
// - Logging: dsv4::set_log_callback installs a std::function (any callable) as the
//   process-wide log sink; dsv4::clear_log_callback restores the default (stderr).
//
// Error handling is the host's choice. By default every method returns the dsv4_status of
// the C call (read dsv4::last_error() for the message). Define DSV4_HPP_EXCEPTIONS before
// including this header to have every failing call throw dsv4::Error (status + message)
// instead; methods then still return DSV4_STATUS_OK on success. Without
// DSV4_HPP_EXCEPTIONS the header throws nothing itself (it compiles with -fno-exceptions;
// only std::vector / std::string allocation failures can throw std::bad_alloc). Destructors
// never throw.
//
// A few errors are detected by the wrapper before any C call (a logits buffer too small, a
// refit session that is not open, a weight name not found). They are reported the same way
// (status or dsv4::Error), and dsv4::last_error() returns their message until the next
// wrapper call that reaches the C ABI. After calling the C functions directly, read
// dsv4_last_error() itself.
//
// Threading and lifetimes are those of the C ABI (see dsv4.h): calls on one Engine (and on
// a RefitSession of it) must be serialized by the host; distinct Engines are independent.
#ifndef DSV4_HPP
#define DSV4_HPP

#include "dsv4.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define DSV4_HPP_HAS_TRY 1
#else
#define DSV4_HPP_HAS_TRY 0
#endif

#if defined(DSV4_HPP_EXCEPTIONS) && !DSV4_HPP_HAS_TRY
#error "DSV4_HPP_EXCEPTIONS needs a build with C++ exceptions enabled"
#endif

namespace dsv4 {

// ---------------------------------------------------------------------------------------
// Versions
// ---------------------------------------------------------------------------------------

/// Run-time ABI version of the loaded library: (major << 16) | minor.
inline uint32_t abi_version() noexcept { return dsv4_abi_version(); }
/// Major of the loaded library's ABI (must equal DSV4_ABI_VERSION_MAJOR).
inline uint32_t abi_major() noexcept { return dsv4_abi_version() >> 16; }
/// Minor of the loaded library's ABI (must be >= DSV4_ABI_VERSION_MINOR).
inline uint32_t abi_minor() noexcept { return dsv4_abi_version() & 0xffffu; }
/// ABI version this header was generated for, in the same encoding as abi_version().
constexpr uint32_t header_abi_version() noexcept {
    return (static_cast<uint32_t>(DSV4_ABI_VERSION_MAJOR) << 16) | static_cast<uint32_t>(DSV4_ABI_VERSION_MINOR);
}
/// Human-readable library version, e.g. "dsv4 0.1.0 (abi 1.3)".
inline std::string version_string() {
    const char *v = dsv4_version_string();
    return v != nullptr ? std::string(v) : std::string();
}

/// True if the loaded library (ABI version `library`, default: the one loaded) can serve
/// a host built against ABI `major`.`minor` (default: this header): same major, library
/// minor >= host minor.
inline bool abi_compatible(uint32_t library = dsv4_abi_version(), uint32_t major = DSV4_ABI_VERSION_MAJOR,
                           uint32_t minor = DSV4_ABI_VERSION_MINOR) noexcept {
    return (library >> 16) == major && (library & 0xffffu) >= minor;
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

namespace detail {
/// Message of an error the wrapper itself detected on this thread ("" when the most recent
/// wrapper call reached the C ABI). Thread-local like dsv4_last_error().
inline std::string &wrapper_error() {
    thread_local std::string message;
    return message;
}
} // namespace detail

/// Message of the most recent failed dsv4 call on this thread ("" after a success): the
/// wrapper's own message when the wrapper rejected the call, else dsv4_last_error().
inline std::string last_error() {
    const std::string &w = detail::wrapper_error();
    if (!w.empty()) {
        return w;
    }
    const char *m = dsv4_last_error();
    return m != nullptr ? std::string(m) : std::string();
}

/// "OK", "INVALID_ARGUMENT", ... for a status code.
inline const char *status_name(dsv4_status s) noexcept { return dsv4_status_name(s); }

/// A failed dsv4 call: its status and dsv4::last_error() at the time of failure.
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
/// After a C call: clears the wrapper's own message, then returns `s`, or throws
/// dsv4::Error for a failure when DSV4_HPP_EXCEPTIONS is defined.
inline dsv4_status check(dsv4_status s) {
    wrapper_error().clear();
#if defined(DSV4_HPP_EXCEPTIONS)
    if (s != DSV4_STATUS_OK) {
        throw Error(s, last_error());
    }
#endif
    return s;
}

/// An error found by the wrapper before any C call: records `message` for last_error(),
/// then returns `s` or throws.
inline dsv4_status fail(dsv4_status s, std::string message) {
    wrapper_error() = std::move(message);
#if defined(DSV4_HPP_EXCEPTIONS)
    throw Error(s, wrapper_error());
#else
    return s;
#endif
}
} // namespace detail

// ---------------------------------------------------------------------------------------
// Logging
// ---------------------------------------------------------------------------------------

/// A log sink: `level` is a DSV4_LOG_* value, `message` one line (no trailing newline),
/// valid only during the call (copy it to keep it).
using LogFn = std::function<void(int32_t level, std::string_view message)>;

namespace detail {
/// The callable installed by set_log_callback. Created on first use and never destroyed,
/// so a message logged during static destruction (or by a thread still running at exit)
/// never reaches a destroyed std::function.
struct LogHolder {
    std::mutex mu;                  ///< serializes set_log_callback / clear_log_callback
    std::unique_ptr<LogFn> current; ///< the `user` pointer handed to the library
};
inline LogHolder &log_holder() {
    static LogHolder *holder = new LogHolder(); // intentionally leaked (see above)
    return *holder;
}

/// The C sink: calls the LogFn that `user` points to. An exception escaping the host's
/// callable is swallowed (the C ABI requires the callback to return normally).
inline void log_trampoline(int32_t level, const char *message, void *user) noexcept {
    const LogFn *fn = static_cast<const LogFn *>(user);
    if (fn == nullptr || !*fn) {
        return;
    }
#if DSV4_HPP_HAS_TRY
    try {
        (*fn)(level, std::string_view(message != nullptr ? message : ""));
    } catch (...) {
    }
#else
    (*fn)(level, std::string_view(message != nullptr ? message : ""));
#endif
}
} // namespace detail

/// Installs `fn` as the process-wide log sink (dsv4_set_log_callback): every message at
/// `max_level` (DSV4_LOG_*) or more severe, from every engine, goes to fn(level, message).
/// An empty `fn` restores the default sink (stderr) with `max_level`.
///
/// Lifetime: the wrapper keeps its own copy of `fn` until the next set_log_callback /
/// clear_log_callback replaces it; the library guarantees that once dsv4_set_log_callback
/// has returned no call into the previous sink is still running, so the previous copy is
/// destroyed right after. (Installing a sink with dsv4_set_log_callback directly leaves the
/// wrapper's copy alive until the wrapper's next call.)
///
/// Thread safety: `fn` may be called from any thread inside a dsv4 call, including worker
/// threads, and concurrently, so it must be thread-safe; the library serializes the calls
/// of one message at a time through its own lock. `fn` must not call set_log_callback,
/// clear_log_callback or dsv4_set_log_callback (that deadlocks); an exception thrown by
/// `fn` is swallowed. Concurrent set_log_callback calls are serialized by the wrapper.
///
/// Errors: INVALID_ARGUMENT (`max_level` not a DSV4_LOG_* value; the previous sink stays).
inline dsv4_status set_log_callback(LogFn fn, int32_t max_level = DSV4_LOG_INFO) {
    detail::LogHolder &h = detail::log_holder();
    std::unique_ptr<LogFn> next;
    dsv4_status s;
    {
        std::lock_guard<std::mutex> lock(h.mu);
        if (fn) {
            next.reset(new LogFn(std::move(fn)));
            s = dsv4_set_log_callback(&detail::log_trampoline, next.get(), max_level);
        } else {
            s = dsv4_set_log_callback(nullptr, nullptr, max_level);
        }
        if (s == DSV4_STATUS_OK) {
            h.current.swap(next); // `next` now holds the previous sink (or the rejected one)
        }
    }
    next.reset(); // destroyed outside the lock: its captures may do anything but log-sink calls
    return detail::check(s);
}

/// Removes the wrapper's sink and restores the library's default (stderr, messages at
/// `max_level` or more severe; default DSV4_LOG_WARN, the library's initial setting).
inline dsv4_status clear_log_callback(int32_t max_level = DSV4_LOG_WARN) { return set_log_callback(LogFn(), max_level); }

// ---------------------------------------------------------------------------------------
// Weights and tensors
// ---------------------------------------------------------------------------------------

/// One weight of an engine (dsv4_weight_desc with an owned name and a sized shape).
/// `data` / `scale` are the engine's storage: fixed addresses, valid until the engine is
/// destroyed; host memory when `device` is DSV4_DEVICE_CPU, else CUDA device memory.
struct WeightInfo {
    std::size_t index = 0;      ///< index for dsv4_weight_info
    std::string name;           ///< canonical name
    int32_t dtype = 0;          ///< DSV4_DTYPE_* of the storage
    std::vector<int64_t> shape; ///< extents (ndim entries)
    const void *data = nullptr;  ///< storage address (read-only for the host)
    uint64_t nbytes = 0;        ///< bytes at `data`
    bool derived = false;       ///< rebuilt by finalize / refit, not loadable by name
    int32_t device = DSV4_DEVICE_CPU;
    const void *scale = nullptr; ///< f32 block scales (FP8/FP4 storage), else NULL
    uint64_t scale_nbytes = 0;  ///< bytes at `scale`
    int32_t scale_block[2] = {0, 0};

    /// Elements of the logical shape (1 for a scalar).
    int64_t numel() const noexcept {
        int64_t n = 1;
        for (int64_t d : shape) {
            n *= d;
        }
        return n;
    }

    static WeightInfo from(std::size_t index, const dsv4_weight_desc &d) {
        WeightInfo w;
        w.index = index;
        w.name = d.name != nullptr ? d.name : "";
        w.dtype = d.dtype;
        const int32_t nd = d.ndim < 0 ? 0 : (d.ndim > DSV4_MAX_DIMS ? DSV4_MAX_DIMS : d.ndim);
        w.shape.assign(d.shape, d.shape + nd);
        w.data = d.data;
        w.nbytes = d.nbytes;
        w.derived = d.derived != 0;
        w.device = d.device;
        w.scale = d.scale;
        w.scale_nbytes = d.scale_nbytes;
        w.scale_block[0] = d.scale_block[0];
        w.scale_block[1] = d.scale_block[1];
        return w;
    }
};

/// A dsv4_tensor for load_tensor / refit. Borrows `name` and `data` (they must outlive the
/// call it is passed to). More than DSV4_MAX_DIMS extents are not copied but `ndim` states
/// their count, so the library rejects the tensor (INVALID_ARGUMENT) instead of reading
/// past `shape`.
inline dsv4_tensor make_tensor(const char *name, int32_t dtype, const std::vector<int64_t> &shape, const void *data,
                               int32_t memory = DSV4_MEMORY_HOST) {
    dsv4_tensor t = dsv4_tensor_default();
    t.name = name;
    t.dtype = dtype;
    t.ndim = static_cast<int32_t>(shape.size());
    for (std::size_t k = 0; k < shape.size() && k < static_cast<std::size_t>(DSV4_MAX_DIMS); ++k) {
        t.shape[k] = shape[k];
    }
    t.data = data;
    t.memory = memory;
    return t;
}

// ---------------------------------------------------------------------------------------
// Batches
// ---------------------------------------------------------------------------------------

/// Deleter for std::unique_ptr<dsv4_engine>.
struct EngineDeleter {
    void operator()(dsv4_engine *e) const noexcept { dsv4_destroy(e); }
};
using EnginePtr = std::unique_ptr<dsv4_engine, EngineDeleter>;

/// Host-side arrays of one forward batch (CPU backend, or any host that fills a
/// dsv4_batch from host memory). Reuse one HostBatch across steps: clear() keeps the
/// capacity of every array, so a decode loop allocates nothing after its first steps.
struct HostBatch {
    std::vector<int32_t> token_ids, positions, seq_slots, query_start{0}, logits_rows;
    bool all_rows = true;
    /// Logits of the last Engine::forward(HostBatch&): num_logits() x vocab_size floats,
    /// resized in place (its storage is reused while the capacity suffices).
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

    /// Empties the batch (keeps every array's capacity, `all_rows` and `logits`).
    void clear() noexcept {
        token_ids.clear();
        positions.clear();
        seq_slots.clear();
        query_start.assign(1, 0);
        logits_rows.clear();
    }

    /// Rows of logits view() asks for.
    std::size_t num_logits() const noexcept { return all_rows ? token_ids.size() : logits_rows.size(); }

    /// A dsv4_batch over these arrays writing float32 logits to `logits_out` (which must
    /// hold num_logits() x vocab_size floats). Valid until this HostBatch is modified or
    /// destroyed.
    dsv4_batch view(float *logits_out) const noexcept {
        dsv4_batch b = dsv4_batch_default();
        b.num_tokens = static_cast<int32_t>(token_ids.size());
        b.num_seqs = static_cast<int32_t>(seq_slots.size());
        b.token_ids = token_ids.data();
        b.positions = positions.data();
        b.seq_slots = seq_slots.data();
        b.query_start = query_start.data();
        b.logits_rows = all_rows ? nullptr : logits_rows.data();
        b.num_logits = static_cast<int32_t>(num_logits());
        b.logits = logits_out;
        b.logits_dtype = DSV4_LOGITS_F32;
        return b;
    }

    /// A dsv4_batch over these arrays writing into `logits`, resized (in place) to
    /// num_logits() x `vocab_size`.
    dsv4_batch view(int32_t vocab_size) {
        logits.resize(num_logits() * static_cast<std::size_t>(vocab_size < 0 ? 0 : vocab_size));
        return view(logits.data());
    }
};

/// A batch whose arrays the host already owns, passed to dsv4_forward as they are (no
/// copy). On the CUDA backend every pointer is CUDA device memory of the engine's device
/// (what dsv4.h calls a device batch: e.g. the fixed input buffers of a captured graph),
/// read - and `logits` written - when `stream` reaches the forward, so they must stay
/// valid and unchanged until then. On the CPU backend they are host pointers read during
/// the call. Counts and pointers follow dsv4_batch; logits_rows = nullptr means every
/// token produces a row (num_logits must then equal num_tokens).
struct BatchView {
    int32_t num_tokens = 0;
    int32_t num_seqs = 0;
    const int32_t *token_ids = nullptr;   ///< [num_tokens]
    const int32_t *positions = nullptr;   ///< [num_tokens]
    const int32_t *seq_slots = nullptr;   ///< [num_seqs] (DSV4_PAD_SLOT for padding)
    const int32_t *query_start = nullptr; ///< [num_seqs + 1]
    const int32_t *logits_rows = nullptr; ///< [num_logits] or nullptr = every token
    int32_t num_logits = 0;
    void *logits = nullptr;               ///< [num_logits x vocab_size] of logits_dtype
    int32_t logits_dtype = DSV4_LOGITS_F32;

    /// The dsv4_batch dsv4_forward receives.
    dsv4_batch batch() const noexcept {
        dsv4_batch b = dsv4_batch_default();
        b.num_tokens = num_tokens;
        b.num_seqs = num_seqs;
        b.token_ids = token_ids;
        b.positions = positions;
        b.seq_slots = seq_slots;
        b.query_start = query_start;
        b.logits_rows = logits_rows;
        b.num_logits = num_logits;
        b.logits = logits;
        b.logits_dtype = logits_dtype;
        return b;
    }
};

class RefitSession;

// ---------------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------------

/// Owns one engine. A default-constructed or moved-from Engine holds NULL; calls on it
/// return DSV4_STATUS_NULL_POINTER (or throw).
///
/// The engine's dsv4_info is cached at construction and refreshed by finalize() and
/// refresh_info(): its config and capacities (vocab_size, max_num_tokens, ...) are fixed
/// from create to destroy, so cached_info() serves them without a C call. The phase
/// changes: read it with info() or phase().
class Engine {
  public:
    Engine() noexcept = default;
    /// Adopts a handle from dsv4_create (or NULL).
    explicit Engine(dsv4_engine *raw) noexcept : ptr_(raw) { refresh_info_noexcept(); }

    Engine(Engine &&o) noexcept : ptr_(std::move(o.ptr_)), info_(o.info_) { o.info_ = zero_info(); }
    Engine &operator=(Engine &&o) noexcept {
        if (this != &o) {
            ptr_ = std::move(o.ptr_);
            info_ = o.info_;
            o.info_ = zero_info();
        }
        return *this;
    }
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;

    /// dsv4_create into `out` (replacing what it held).
    static dsv4_status create(const dsv4_create_params &params, Engine &out) {
        dsv4_engine *raw = nullptr;
        const dsv4_status s = dsv4_create(&params, &raw);
        if (s == DSV4_STATUS_OK) {
            out.ptr_.reset(raw);
            out.refresh_info_noexcept();
        }
        return detail::check(s);
    }

#if defined(DSV4_HPP_EXCEPTIONS)
    /// Creates the engine or throws dsv4::Error.
    explicit Engine(const dsv4_create_params &params) { create(params, *this); }
#endif

    // --- lifecycle --------------------------------------------------------------------

    /// dsv4_load: `source` may be nullptr for DSV4_LOAD_DUMMY.
    dsv4_status load(const char *source, int32_t format = DSV4_LOAD_AUTO) {
        return detail::check(dsv4_load(ptr_.get(), source, format));
    }
    dsv4_status load(const std::string &source, int32_t format = DSV4_LOAD_AUTO) {
        return load(source.c_str(), format);
    }
    dsv4_status load_dummy() { return load(nullptr, DSV4_LOAD_DUMMY); }
    dsv4_status load_tensor(const dsv4_tensor &t) { return detail::check(dsv4_load_tensor(ptr_.get(), &t)); }
    /// dsv4_finalize (on `stream`, CUDA), then refreshes the cached info.
    dsv4_status finalize(void *stream = nullptr) {
        const dsv4_status s = dsv4_finalize(ptr_.get(), stream);
        if (s == DSV4_STATUS_OK) {
            refresh_info_noexcept();
        }
        return detail::check(s);
    }

    // --- forward ----------------------------------------------------------------------

    /// dsv4_forward of a dsv4_batch the host filled itself (host pointers on the CPU
    /// backend, device pointers on CUDA; see BatchView and dsv4.h for lifetimes).
    dsv4_status forward(const dsv4_batch &b, void *stream = nullptr) {
        return detail::check(dsv4_forward(ptr_.get(), &b, stream));
    }

    /// Device forward (CUDA hosts): `b`'s arrays are device memory the host owns - e.g. the
    /// fixed buffers a captured graph replays - and the call only enqueues the forward on
    /// `stream` (a CUstream; nullptr = the legacy default stream). Nothing is copied or
    /// synchronized: the logits are ready when later work on `stream` runs. A bad batch
    /// value is not reported here but by device_error() (its logits rows are NaN). On the
    /// CPU backend the same call runs host arrays synchronously.
    dsv4_status forward(const BatchView &b, void *stream = nullptr) { return forward(b.batch(), stream); }

    /// Host forward into the caller's `logits`: resized in place to num_logits x vocab_size
    /// floats (the vocabulary from the cached info; no C call besides dsv4_forward), so a
    /// vector reused across steps is reallocated only when a batch needs more rows than
    /// any before it (reserve max_logits_floats() up front to never reallocate).
    dsv4_status forward(const HostBatch &b, std::vector<float> &logits, void *stream = nullptr) {
        const std::size_t vocab = vocab_size_or_zero();
        if (vocab == 0) {
            return vocab_unknown();
        }
        logits.resize(b.num_logits() * vocab);
        return forward(b.view(logits.data()), stream);
    }

    /// Host forward into a caller-owned buffer of `capacity` floats. It must hold
    /// num_logits x vocab_size floats: a smaller one is INVALID_ARGUMENT (nothing is
    /// written, nothing runs), never an overflow.
    dsv4_status forward(const HostBatch &b, float *logits, std::size_t capacity, void *stream = nullptr) {
        const std::size_t vocab = vocab_size_or_zero();
        if (vocab == 0) {
            return vocab_unknown();
        }
        const std::size_t need = b.num_logits() * vocab;
        if (capacity < need) {
            return detail::fail(DSV4_STATUS_INVALID_ARGUMENT,
                                "logits buffer of " + std::to_string(capacity) + " floats is too small for " +
                                    std::to_string(b.num_logits()) + " logits rows x vocab_size " +
                                    std::to_string(vocab) + " = " + std::to_string(need) + " floats");
        }
        return forward(b.view(logits), stream);
    }

    /// Host forward into `b.logits` (the HostBatch's own reused vector).
    dsv4_status forward(HostBatch &b, void *stream = nullptr) { return forward(b, b.logits, stream); }

    /// Floats of the largest logits output a batch can ask for (max_num_tokens x vocab_size).
    std::size_t max_logits_floats() const noexcept {
        return static_cast<std::size_t>(info_.max_num_tokens < 0 ? 0 : info_.max_num_tokens) * vocab_size_or_zero();
    }

    // --- refit ------------------------------------------------------------------------

    /// dsv4_refit in one call (DSV4_PHASE_READY: derived buffers rebuilt now).
    dsv4_status refit(const dsv4_tensor *tensors, std::size_t n, void *stream = nullptr) {
        return detail::check(dsv4_refit(ptr_.get(), tensors, n, stream));
    }
    dsv4_status refit(const std::vector<dsv4_tensor> &tensors, void *stream = nullptr) {
        return refit(tensors.data(), tensors.size(), stream);
    }

    /// Opens a chunked refit (dsv4_refit_begin) and returns its guard; see RefitSession.
    /// With DSV4_HPP_EXCEPTIONS a failing begin throws; otherwise the returned session is
    /// not open and its begin_status() is the failure.
    RefitSession refit_session(void *stream = nullptr);

    /// The raw chunked-refit calls, for hosts that manage the phase themselves (prefer
    /// refit_session, whose destructor cannot forget to close the refit).
    dsv4_status refit_begin() { return detail::check(dsv4_refit_begin(ptr_.get())); }
    dsv4_status refit_end(void *stream = nullptr) { return detail::check(dsv4_refit_end(ptr_.get(), stream)); }
    dsv4_status refit_abort(void *stream = nullptr) { return detail::check(dsv4_refit_abort(ptr_.get(), stream)); }

    // --- slots and faults -------------------------------------------------------------

    /// dsv4_release_slot: forgets slot `slot`'s sequence (CUDA: blocks until the device's
    /// queued work is done; not inside a graph capture).
    dsv4_status release_slot(int32_t slot) { return detail::check(dsv4_release_slot(ptr_.get(), slot)); }

    /// dsv4_slot_length: positions slot `slot` holds now (0 if unused or released). CUDA: read
    /// after the work on `stream` has run (blocks the host; not inside a graph capture).
    dsv4_status slot_length(int32_t slot, int32_t &out, void *stream = nullptr) const {
        return detail::check(dsv4_slot_length(ptr_.get(), slot, stream, &out));
    }

    /// dsv4_canonical_name: what a tensor name of any accepted scheme stands for (`kind`,
    /// DSV4_NAME_*) and its canonical name in `out`.
    dsv4_status canonical_name(const std::string &name, std::string &out, int32_t &kind) const {
        std::size_t len = 0;
        dsv4_status s = dsv4_canonical_name(ptr_.get(), name.c_str(), nullptr, 0, &len, &kind);
        if (s != DSV4_STATUS_CAPACITY) {
            return detail::check(s);  // an error (an OK here would mean an empty name)
        }
        std::vector<char> buf(len + 1);
        s = dsv4_canonical_name(ptr_.get(), name.c_str(), buf.data(), buf.size(), &len, &kind);
        if (s == DSV4_STATUS_OK) {
            out.assign(buf.data(), len);
        }
        return detail::check(s);
    }

    /// dsv4_device_error: returns and clears the first fault of a bad batch that a CUDA
    /// engine's forwards met since the last call. Syncs `stream` (never call it inside a
    /// graph capture). DSV4_STATUS_OK with `out` zeroed when there is none (always on the
    /// CPU backend); otherwise the fault's status, `out` holding field, index, value, rule,
    /// and dsv4::last_error() the message. A fault is a report, not a failure of this call,
    /// so it never throws; a failure of the call itself (e.g. DSV4_STATUS_CUDA) does when
    /// DSV4_HPP_EXCEPTIONS is defined.
    dsv4_status device_error(dsv4_batch_fault &out, void *stream = nullptr) {
        const dsv4_status s = dsv4_device_error(ptr_.get(), stream, &out);
        detail::wrapper_error().clear();
        if (s != DSV4_STATUS_OK && out.status != s) {
            return detail::check(s);
        }
        return s;
    }

    // --- queries ----------------------------------------------------------------------

    /// dsv4_get_info into `out` (phase included); refreshes the cached info on success.
    dsv4_status info(dsv4_info &out) {
        out = zero_info();
        const dsv4_status s = dsv4_get_info(ptr_.get(), &out);
        if (s == DSV4_STATUS_OK) {
            info_ = out;
        }
        return detail::check(s);
    }
    /// dsv4_get_info without touching the cache (usable on a const Engine).
    dsv4_status info(dsv4_info &out) const {
        out = zero_info();
        return detail::check(dsv4_get_info(ptr_.get(), &out));
    }
    /// dsv4_get_info as a value: all zeros (struct_size aside) on failure, or throws.
    dsv4_info info() const {
        dsv4_info i = zero_info();
        if (info(i) != DSV4_STATUS_OK) {
            i = zero_info();
        }
        return i;
    }
    /// The current DSV4_PHASE_*, or -1 if it cannot be read (empty Engine).
    int32_t phase() const noexcept {
        detail::wrapper_error().clear();
        dsv4_info i = zero_info();
        return dsv4_get_info(ptr_.get(), &i) == DSV4_STATUS_OK ? i.phase : -1;
    }
    /// The info cached at create / finalize / refresh_info (its `phase` is the phase then;
    /// config and capacities never change). All zeros for an empty Engine.
    const dsv4_info &cached_info() const noexcept { return info_; }
    /// Re-reads the cached info.
    dsv4_status refresh_info() {
        dsv4_info i;
        return info(i);
    }
    /// Vocabulary size from the cached info.
    int32_t vocab_size() const noexcept { return info_.vocab_size; }

    /// dsv4_weight_count.
    dsv4_status weight_count(std::size_t &out) const { return detail::check(dsv4_weight_count(ptr_.get(), &out)); }
    /// dsv4_weight_info of weight `index`.
    dsv4_status weight(std::size_t index, dsv4_weight_desc &out) const {
        std::memset(&out, 0, sizeof out);
        out.struct_size = sizeof(dsv4_weight_desc);
        return detail::check(dsv4_weight_info(ptr_.get(), index, &out));
    }
    /// dsv4_weight_info of weight `index` as a WeightInfo.
    dsv4_status weight(std::size_t index, WeightInfo &out) const {
        dsv4_weight_desc d;
        const dsv4_status s = weight(index, d);
        if (s == DSV4_STATUS_OK) {
            out = WeightInfo::from(index, d);
        }
        return s;
    }
    /// The weight named `name` (canonical name, as dsv4_weight_info reports it):
    /// DSV4_STATUS_TENSOR if there is none.
    dsv4_status find_weight(const std::string &name, WeightInfo &out) const {
        std::size_t n = 0;
        dsv4_status s = weight_count(n);
        if (s != DSV4_STATUS_OK) {
            return s;
        }
        for (std::size_t i = 0; i < n; ++i) {
            dsv4_weight_desc d;
            s = weight(i, d);
            if (s != DSV4_STATUS_OK) {
                return s;
            }
            if (d.name != nullptr && name == d.name) {
                out = WeightInfo::from(i, d);
                return s;
            }
        }
        return detail::fail(DSV4_STATUS_TENSOR, "no weight named `" + name + "` in this engine");
    }
    /// Every weight (sources, then derived tensors) into `out`.
    dsv4_status weights(std::vector<WeightInfo> &out) const {
        out.clear();
        std::size_t n = 0;
        dsv4_status s = weight_count(n);
        if (s != DSV4_STATUS_OK) {
            return s;
        }
        out.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
            dsv4_weight_desc d;
            s = weight(i, d);
            if (s != DSV4_STATUS_OK) {
                out.clear();
                return s;
            }
            out.push_back(WeightInfo::from(i, d));
        }
        return s;
    }
    /// Every weight as a value: empty on failure, or throws.
    std::vector<WeightInfo> weights() const {
        std::vector<WeightInfo> out;
        weights(out);
        return out;
    }

    dsv4_engine *get() const noexcept { return ptr_.get(); }
    /// Gives up ownership (the caller must dsv4_destroy the result).
    dsv4_engine *release() noexcept {
        info_ = zero_info();
        return ptr_.release();
    }
    explicit operator bool() const noexcept { return ptr_ != nullptr; }

  private:
    static dsv4_info zero_info() noexcept {
        dsv4_info i;
        std::memset(&i, 0, sizeof i);
        i.struct_size = sizeof(dsv4_info);
        return i;
    }
    void refresh_info_noexcept() noexcept {
        dsv4_info i = zero_info();
        info_ = dsv4_get_info(ptr_.get(), &i) == DSV4_STATUS_OK ? i : zero_info();
    }
    std::size_t vocab_size_or_zero() const noexcept {
        return info_.vocab_size > 0 ? static_cast<std::size_t>(info_.vocab_size) : 0;
    }
    dsv4_status vocab_unknown() {
        if (!ptr_) {
            return detail::fail(DSV4_STATUS_NULL_POINTER, "`engine` is NULL (empty dsv4::Engine)");
        }
        return detail::fail(DSV4_STATUS_STATE, "vocab_size unknown: dsv4_get_info failed (" + last_error() + ")");
    }

    EnginePtr ptr_;
    dsv4_info info_ = zero_info();
};

// ---------------------------------------------------------------------------------------
// Chunked refit guard
// ---------------------------------------------------------------------------------------

/// One chunked refit (dsv4_refit_begin .. dsv4_refit_end), scoped:
///
///     {
///         auto g = engine.refit_session(stream);  // dsv4_refit_begin
///         g.refit(chunk0);                         // dsv4_refit, each chunk all-or-nothing
///         g.refit(chunk1);
///         g.end();                                 // dsv4_refit_end: derived buffers rebuilt
///     }
///
/// If the scope is left while the refit is open - an exception, an early return, end()
/// failing - the destructor calls dsv4_refit_abort: the chunks that succeeded stay written,
/// stored-format halves still waiting for their partner are dropped, derived buffers are
/// rebuilt, and the engine is DSV4_PHASE_READY again. The destructor never throws; it keeps
/// dsv4::last_error() showing the failure that ended the scope (not the abort's "").
///
/// end() that fails (e.g. DSV4_STATUS_TENSOR: a stored-format half without its partner)
/// leaves the refit open: send the missing halves with refit() and call end() again, or
/// abort(). The session borrows the engine's handle: the Engine must outlive it (moving
/// the Engine is fine, destroying it is not). Movable, not copyable.
class RefitSession {
  public:
    RefitSession() noexcept = default;
    RefitSession(RefitSession &&o) noexcept
        : engine_(o.engine_), stream_(o.stream_), open_(o.open_), begin_status_(o.begin_status_) {
        o.open_ = false;
    }
    RefitSession &operator=(RefitSession &&o) noexcept {
        if (this != &o) {
            close_noexcept();
            engine_ = o.engine_;
            stream_ = o.stream_;
            open_ = o.open_;
            begin_status_ = o.begin_status_;
            o.open_ = false;
        }
        return *this;
    }
    RefitSession(const RefitSession &) = delete;
    RefitSession &operator=(const RefitSession &) = delete;
    ~RefitSession() { close_noexcept(); }

    /// True while the refit is open (begin succeeded, neither end() nor abort() has).
    bool is_open() const noexcept { return open_; }
    explicit operator bool() const noexcept { return open_; }
    /// Status of dsv4_refit_begin (the reason a session is not open from the start).
    dsv4_status begin_status() const noexcept { return begin_status_; }

    /// One chunk (dsv4_refit on the session's stream): all-or-nothing; a failed chunk
    /// changes nothing and the refit stays open. STATE if the session is not open.
    dsv4_status refit(const dsv4_tensor *tensors, std::size_t n) {
        if (!open_) {
            return not_open("refit");
        }
        return detail::check(dsv4_refit(engine_, tensors, n, stream_));
    }
    dsv4_status refit(const std::vector<dsv4_tensor> &tensors) { return refit(tensors.data(), tensors.size()); }

    /// dsv4_refit_end: rebuilds derived buffers, engine READY, session closed. On failure
    /// the session stays open (see the class comment).
    dsv4_status end() {
        if (!open_) {
            return not_open("end");
        }
        const dsv4_status s = dsv4_refit_end(engine_, stream_);
        if (s == DSV4_STATUS_OK) {
            open_ = false;
        }
        return detail::check(s);
    }

    /// dsv4_refit_abort now (what the destructor would do), reporting its status. On
    /// failure (CUDA) the session stays open and the destructor tries again.
    dsv4_status abort() {
        if (!open_) {
            return not_open("abort");
        }
        const dsv4_status s = dsv4_refit_abort(engine_, stream_);
        if (s == DSV4_STATUS_OK) {
            open_ = false;
        }
        return detail::check(s);
    }

  private:
    friend class Engine;
    RefitSession(dsv4_engine *engine, void *stream, dsv4_status begin) noexcept
        : engine_(engine), stream_(stream), open_(begin == DSV4_STATUS_OK), begin_status_(begin) {}

    dsv4_status not_open(const char *what) {
        return detail::fail(DSV4_STATUS_STATE, std::string("dsv4::RefitSession::") + what +
                                                   ": the session is not open (begin failed, or end/abort "
                                                   "already closed it)");
    }

    /// Aborts an open refit, keeping last_error() on the failure that ended the scope.
    void close_noexcept() noexcept {
        if (!open_) {
            return;
        }
        open_ = false;
        std::string before;
#if DSV4_HPP_HAS_TRY
        try {
            before = last_error();
        } catch (...) { // out of memory: the abort matters more than the message
        }
#else
        before = last_error();
#endif
        const dsv4_status s = dsv4_refit_abort(engine_, stream_);
#if DSV4_HPP_HAS_TRY
        try {
#endif
            if (s != DSV4_STATUS_OK) {
                const char *m = dsv4_last_error();
                before += std::string(before.empty() ? "" : "; then ") + "dsv4_refit_abort failed (" +
                          dsv4_status_name(s) + "): " + (m != nullptr ? m : "");
            }
            detail::wrapper_error() = std::move(before);
#if DSV4_HPP_HAS_TRY
        } catch (...) {
        }
#endif
    }

    dsv4_engine *engine_ = nullptr;
    void *stream_ = nullptr;
    bool open_ = false;
    dsv4_status begin_status_ = DSV4_STATUS_STATE;
};

inline RefitSession Engine::refit_session(void *stream) {
    const dsv4_status s = dsv4_refit_begin(ptr_.get());
    RefitSession session(ptr_.get(), stream, s);
    detail::check(s);
    return session;
}

} // namespace dsv4

#endif // DSV4_HPP

"""``dsv4.Engine``: one model on one device, over the C ABI.

numpy in, numpy out; torch tensors are accepted too (torch in, torch out) through
``_torch.py``, which never imports torch by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import threading
from typing import Iterable, Mapping

import numpy as np

from . import _errors, _lib, _torch
from ._errors import invalid

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# numpy dtype -> DSV4_DTYPE_*
_NP_DTYPES = {
    np.dtype(np.float32): _lib.DTYPE_F32,
    np.dtype(np.float16): _lib.DTYPE_F16,
    np.dtype(np.int32): _lib.DTYPE_I32,
    np.dtype(np.int64): _lib.DTYPE_I64,
}
# Storage dtype -> numpy element type of weight_array(): BF16 as uint16 bit patterns,
# quantized codes and E8M0 scales as raw bytes (FP4 packed two per byte).
_STORAGE_NP = {_lib.DTYPE_F32: np.float32, _lib.DTYPE_I32: np.int32, _lib.DTYPE_F16: np.float16,
               _lib.DTYPE_I64: np.int64, _lib.DTYPE_BF16: np.uint16, _lib.DTYPE_F8_E4M3: np.uint8,
               _lib.DTYPE_FP4_E2M1: np.uint8, _lib.DTYPE_E8M0: np.uint8,
               _lib.DTYPE_F64: np.float64}
# Plain numpy conversion targets for `dtype=` spelled the way the C header does.
_NP_ALIASES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}
_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


def _device_ordinal(device) -> int:
    if isinstance(device, int):
        return device
    if type(device).__name__ == "device" and hasattr(device, "type"):  # torch.device
        device = str(device)
    if not isinstance(device, str):
        raise invalid(f"device must be 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")
    d = device.strip().lower()
    if d == "cpu":
        return _lib.DEVICE_CPU
    if d == "cuda":
        return 0
    if d.startswith("cuda:") and d[5:].isdigit():
        return int(d[5:])
    raise invalid(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _choice(value, table: Mapping[str, int], what: str) -> int:
    key = value.lower() if isinstance(value, str) else value
    if key not in table:
        raise invalid(f"{what} must be one of {sorted(table)}, got {value!r}")
    return table[key]


def _int32_array(values, what: str) -> np.ndarray:
    """A contiguous 1-D int32 copy/view of `values`, range-checked (no silent wrap-around)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise invalid(f"{what} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise invalid(f"{what} must hold integers, got dtype {a.dtype}")
    if a.size and (a.min() < _INT32_MIN or a.max() > _INT32_MAX):
        raise invalid(f"{what} has values outside int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _numpy_source(name: str, array, dtype):
    """(DSV4_DTYPE_* code, logical shape, contiguous array) for one host array and `dtype=`.

    ``dtype``: None (from the array; float64 becomes float32, ml_dtypes bfloat16 /
    float8_e4m3fn / float8_e8m0fnu are recognized), "bf16" (float values, rounded to nearest
    even, or uint16 bit patterns), "fp8_e4m3" / "e8m0" (uint8 codes), "fp4_e2m1" (packed
    uint8 codes [..., cols/2], passed with the logical shape [..., cols]), or a numpy type.
    """
    a = np.asarray(array)
    key = dtype.strip().lower() if isinstance(dtype, str) else None
    code = _lib.STORED_DTYPES.get(key)
    if code == _lib.DTYPE_BF16:
        if a.dtype.name == "bfloat16" or a.dtype == np.uint16:
            a = np.ascontiguousarray(a).view(np.uint16)
        elif np.issubdtype(a.dtype, np.floating):
            f = np.ascontiguousarray(a, dtype=np.float32)
            bits = f.view(np.uint32).astype(np.uint64)
            a = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        else:
            raise invalid(f"weight `{name}`: cannot use dtype {a.dtype} as bf16")
    elif code is not None:  # FP8 / E8M0 / FP4: raw bytes, never quantized here
        ml = {_lib.DTYPE_F8_E4M3: "float8_e4m3fn", _lib.DTYPE_E8M0: "float8_e8m0fnu"}.get(code)
        if a.dtype not in _BYTES and a.dtype.name != ml:
            raise invalid(f"weight `{name}`: dtype={dtype!r} needs uint8 codes, got {a.dtype} "
                          f"(the binding does not quantize; use weight_format='quantize' for that)")
        a = np.ascontiguousarray(a).view(np.uint8)
    elif dtype is None and a.dtype.name == "bfloat16":  # ml_dtypes / jax bfloat16 arrays
        a, code = np.ascontiguousarray(a).view(np.uint16), _lib.DTYPE_BF16
    elif dtype is None and a.dtype.name == "float8_e4m3fn":
        a, code = np.ascontiguousarray(a).view(np.uint8), _lib.DTYPE_F8_E4M3
    elif dtype is None and a.dtype.name == "float8_e8m0fnu":
        a, code = np.ascontiguousarray(a).view(np.uint8), _lib.DTYPE_E8M0
    else:
        if dtype is not None:
            try:
                a = a.astype(_NP_ALIASES.get(key) or np.dtype(dtype), copy=False)
            except TypeError as e:
                raise invalid(f"weight `{name}`: unknown dtype {dtype!r} ({e})") from None
        elif a.dtype == np.float64:
            a = a.astype(np.float32)
        if a.dtype not in _NP_DTYPES:
            raise invalid(f"weight `{name}`: unsupported dtype {a.dtype} (use float32, float16, int32, int64, "
                          f"dtype='bf16', or uint8 codes with dtype='fp8_e4m3' / 'e8m0' / 'fp4_e2m1')")
        code = _NP_DTYPES[a.dtype]
    a = np.ascontiguousarray(a)
    shape = tuple(int(d) for d in a.shape)
    if code == _lib.DTYPE_FP4_E2M1:
        if not shape:
            raise invalid(f"weight `{name}`: packed FP4 needs at least one dimension")
        shape = shape[:-1] + (2 * shape[-1],)  # the ABI takes the logical shape
    return code, shape, a


def _split_entry(value, dtype):
    """A refit value is an array/tensor, or ``(array, dtype)`` to give one entry its own dtype."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return value[0], value[1]
    return value, dtype


def _tensor_entry(name, value, dtype, engine_device: int):
    """(dsv4_tensor, kept-alive objects, is_torch) for one named numpy array or torch tensor."""
    if not isinstance(name, str) or not name:
        raise invalid(f"weight name must be a non-empty str, got {name!r}")
    if _torch.is_tensor(value):
        code, shape, ptr, memory, kept = _torch.weight_source(name, value, dtype, engine_device)
    else:
        code, shape, kept = _numpy_source(name, value, dtype)
        ptr, memory = (kept.ctypes.data if kept.size else None), _lib.MEMORY_HOST
    if len(shape) > _lib.MAX_DIMS:
        raise invalid(f"weight `{name}`: {len(shape)} dimensions (at most {_lib.MAX_DIMS})")
    bname = name.encode("utf-8")
    t = _lib.lib().dsv4_tensor_default()
    t.name = bname
    t.dtype = code
    t.ndim = len(shape)
    for k, d in enumerate(shape):
        t.shape[k] = d
    t.data = ptr
    t.memory = memory
    return t, (kept, bname), _torch.is_tensor(value)


@dataclasses.dataclass(frozen=True)
class BatchFault:
    """The first fault of a bad batch on a CUDA engine (:meth:`Engine.device_error`).

    ``status``: "INVALID_ARGUMENT" or "CAPACITY"; ``field``: the batch array ("token_ids",
    "positions", "seq_slots", "query_start", "logits_rows"); ``index``/``value``: where and
    what; ``rule``: "range", "duplicate", "not_increasing", "endpoint", "not_consecutive" or
    "not_continuing"; ``expected``: the rule's bound or expected value; ``seq``/``slot``: the
    sequence it belongs to (-1: none); ``message``: the text the CPU backend would raise."""

    status: str
    field: str
    index: int
    value: int
    rule: str
    expected: int
    seq: int
    slot: int
    message: str


def _create_params(lib, model_dir, device, max_num_seqs, max_num_tokens, max_seq_len, load, numerics,
                   config_json, num_threads, weight_format, cache_dir, kernel_set, staging_nbytes=0):
    """dsv4_create_params for Engine's arguments, and the byte strings it points to (keep them
    alive while the params are used)."""
    load_code = None if load is None else _choice(load, _lib.LOAD, "load")
    p = lib.dsv4_create_params_default()
    keep = []
    if config_json is not None:
        text = config_json.encode("utf-8")
        keep.append(text)
        p.config_json = text
    elif model_dir is not None:
        path = str(model_dir).encode("utf-8")
        keep.append(path)
        p.config_path = path
    elif load_code == _lib.LOAD["dummy"] or load is None:
        p.use_tiny_default = 1
    else:
        raise invalid(f"load={load!r} needs model_dir (use load='dummy' for the embedded tiny model)")
    if load_code is not None and load_code != _lib.LOAD["dummy"] and model_dir is None:
        raise invalid(f"load={load!r} needs model_dir (the checkpoint to read)")
    p.device = _device_ordinal(device)
    for field, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_tokens", max_num_tokens),
        ("max_seq_len", max_seq_len),
        ("num_threads", num_threads),
    ):
        if not isinstance(value, (int, np.integer)) or not _INT32_MIN <= int(value) <= _INT32_MAX:
            raise invalid(f"{field} must be an int32, got {value!r}")
        setattr(p, field, int(value))
    p.numerics = _choice(numerics, _lib.NUMERICS, "numerics")
    p.weight_format = _choice(weight_format, _lib.WEIGHT_FORMAT, "weight_format")
    if cache_dir is not None:
        c = str(cache_dir).encode("utf-8")
        keep.append(c)
        p.cache_dir = c
    if kernel_set is not None:
        k = str(kernel_set).encode("utf-8")
        keep.append(k)
        p.kernel_set = k
    if not isinstance(staging_nbytes, (int, np.integer)) or not 0 <= int(staging_nbytes) < 1 << 64:
        raise invalid(f"staging_nbytes must be a non-negative int, got {staging_nbytes!r}")
    p.staging_nbytes = int(staging_nbytes)
    return p, keep


def plan_memory(model_dir=None, device="cpu", max_num_seqs=8, max_num_tokens=512, max_seq_len=4096,
                numerics="official", config_json=None, weight_format="as_stored", kernel_set=None,
                load="dummy") -> dict:
    """The memory an :class:`Engine` created with these arguments would use, by kind, without
    creating it (``dsv4_plan_memory``; allocates nothing, needs no GPU for ``device="cuda:N"``):
    ``weights_nbytes``, ``derived_nbytes``, ``state_nbytes`` (all slots), ``state_slot_nbytes``
    (one slot at ``max_seq_len``), ``workspace_nbytes``, ``device_nbytes``, ``host_nbytes``.
    After create, :meth:`Engine.info` reports the same figures. ``load`` only decides, as for
    Engine, whether ``model_dir=None`` means the embedded tiny model."""
    lib = _lib.lib()
    p, keep = _create_params(lib, model_dir, device, max_num_seqs, max_num_tokens, max_seq_len, load, numerics,
                             config_json, 0, weight_format, None, kernel_set)
    m = _lib.MemoryPlan()
    m.struct_size = ctypes.sizeof(_lib.MemoryPlan)
    _lib.check(lib.dsv4_plan_memory(ctypes.byref(p), ctypes.byref(m)))
    del keep
    return {name: getattr(m, name) for name, _ in _lib.MemoryPlan._fields_ if name != "struct_size"}


class Engine:
    """A dsv4 engine: create + load + finalize in the constructor.

    ``model_dir`` is a checkpoint directory holding config.json (and the weights for
    ``load="auto"``). ``model_dir=None`` with ``load="dummy"`` uses the embedded tiny demo
    model. ``config_json`` (text) overrides the config source. ``load=None`` only creates
    the engine: stream weights with :meth:`load_tensor` and call :meth:`finalize`.
    ``kernel_set`` picks the CUDA kernel set ("reference" or "fast"; None = the default:
    "fast" for official numerics on an sm_90 (Hopper) GPU, else "reference"); a name the
    library lacks, "fast" with exact numerics, or "fast" on a GPU without sm_90a raises
    :class:`ConfigError`. ``staging_nbytes`` (CUDA) bounds the pinned host memory weights are
    written through (0 = 256 MiB; the engine keeps no host copy of the weights).

    Calls on one Engine are serialized by an internal lock (the C ABI requires it);
    distinct Engines run independently. Every failure raises :class:`dsv4.Error` (a
    subclass per status) carrying ``.status`` and ``.message``.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        device: str | int = "cpu",
        max_num_seqs: int = 8,
        max_num_tokens: int = 512,
        max_seq_len: int = 4096,
        load: str | None = "auto",
        numerics: str = "official",
        config_json: str | None = None,
        num_threads: int = 0,
        weight_format: str = "as_stored",
        cache_dir: str | None = None,
        kernel_set: str | None = None,
        staging_nbytes: int = 0,
    ):
        self._handle = None
        self._lock = threading.RLock()
        lib = _lib.lib()
        self._lib = lib
        load_code = None if load is None else _choice(load, _lib.LOAD, "load")
        p, keep = _create_params(lib, model_dir, device, max_num_seqs, max_num_tokens, max_seq_len, load,
                                 numerics, config_json, num_threads, weight_format, cache_dir, kernel_set,
                                 staging_nbytes)
        self._device = p.device

        handle = ctypes.c_void_p()
        _lib.check(lib.dsv4_create(ctypes.byref(p), ctypes.byref(handle)))
        self._handle = handle
        info = self.info()
        self.vocab_size = info["vocab_size"]
        if load_code is None:
            return
        try:
            source = None if load_code == _lib.LOAD["dummy"] else str(model_dir).encode("utf-8")
            self._call(lib.dsv4_load, source, load_code)
            self.finalize()
        except BaseException:
            self.close()
            raise

    # -- plumbing ---------------------------------------------------------------------

    def _h(self):
        if self._handle is None:
            raise _lib.error_for(3, "the engine is closed")
        return self._handle

    def _call(self, fn, *args):
        with self._lock:
            _lib.check(fn(self._h(), *args))

    def _stream(self, stream, torch_inputs: bool = False) -> int | None:
        """The CUstream for a call: ``stream`` converted (int / torch.cuda.Stream / None);
        None with torch inputs on a CUDA engine means torch's current stream, so the call is
        ordered after the work that produced the tensors (and is captured by torch.cuda.graph)."""
        if stream is None and torch_inputs and self._device != _lib.DEVICE_CPU:
            return _torch.current_stream(self._device)
        return _torch.stream_handle(stream, self._device)

    # -- lifecycle ----------------------------------------------------------------------

    def load_tensor(self, name: str, array, dtype: str | None = None) -> None:
        """Loads one weight (before finalize) from a numpy array or a torch tensor; ``dtype``
        as for :meth:`refit_many`. A CUDA tensor is read by the library outside any stream of
        torch's, so torch's current stream is synchronized first (loading is not a hot path)."""
        t, keep, _ = _tensor_entry(name, array, dtype, self._device)
        if t.memory == _lib.MEMORY_DEVICE and self._device != _lib.DEVICE_CPU:
            _torch.synchronize_current(self._device)
        self._call(self._lib.dsv4_load_tensor, ctypes.byref(t))
        del keep

    def finalize(self, stream=None) -> None:
        """Rebuilds derived tensors and makes the engine runnable (idempotent). ``stream``:
        None (legacy default stream), an int CUstream or a torch.cuda.Stream."""
        self._call(self._lib.dsv4_finalize, self._stream(stream))

    def forward(self, token_ids, positions, seq_slots, query_start, logits_rows=None,
                stream=None, logits=None):
        """Runs one batch; returns the logits ``[len(logits_rows) or num_tokens, vocab]``.

        ``token_ids``/``positions``: per token; ``seq_slots``: per sequence;
        ``query_start``: ``num_seqs + 1`` offsets; ``logits_rows``: token rows that produce
        logits (None = all).

        CPU engine: numpy arrays, lists or torch CPU tensors (any integer dtype, range-checked).
        The result is float32 numpy, or a torch tensor when any input is a torch tensor;
        ``logits=`` may be a caller-owned output (numpy float32, or a torch float32/bfloat16
        tensor of shape [rows, vocab]), which is filled and returned.

        CUDA engine: the arrays must be contiguous 1-D int32 torch tensors on the engine's
        device (InvalidArgumentError naming the argument otherwise). ``logits=`` a contiguous
        float32/bfloat16 CUDA tensor [rows, vocab] receives the output; without it a float32
        one is allocated with torch.empty. Nothing else is allocated, nothing waits for the
        device and no device value is read, so the call can be captured with
        ``torch.cuda.graph``: the graph replays with whatever the static input tensors then
        hold. ``stream``: None = torch's current stream, an int CUstream, or a torch.cuda.Stream.
        """
        if self._device != _lib.DEVICE_CPU:
            return self._forward_device(token_ids, positions, seq_slots, query_start, logits_rows,
                                        stream, logits)
        arrays = (token_ids, positions, seq_slots, query_start, logits_rows)
        torch_io = any(_torch.is_tensor(a) for a in (*arrays, logits))

        def ints(values, what):
            if _torch.is_tensor(values):
                values = _torch.host_numpy(values, what)
            return _int32_array(values, what)

        tok = ints(token_ids, "token_ids")
        pos = ints(positions, "positions")
        slots = ints(seq_slots, "seq_slots")
        qs = ints(query_start, "query_start")
        rows = None if logits_rows is None else ints(logits_rows, "logits_rows")
        if len(pos) != len(tok):
            raise invalid(f"positions has {len(pos)} entries, token_ids {len(tok)}")
        if len(qs) != len(slots) + 1:
            raise invalid(f"query_start has {len(qs)} entries, expected len(seq_slots) + 1 = {len(slots) + 1}")
        n_rows = len(tok) if rows is None else len(rows)
        if logits is None:
            out = np.empty((n_rows, self.vocab_size), dtype=np.float32)
            out_ptr, out_code = (out.ctypes.data if out.size else None), _lib.LOGITS_F32
        elif _torch.is_tensor(logits):
            out_code = _torch.logits_code(logits, n_rows, self.vocab_size, self._device)
            out_ptr = logits.data_ptr() if logits.numel() else None
        else:
            out_ptr, out_code = self._numpy_logits(logits, n_rows), _lib.LOGITS_F32
        b = self._lib.dsv4_batch_default()
        b.num_tokens = len(tok)
        b.num_seqs = len(slots)
        b.token_ids = _ptr(tok)
        b.positions = _ptr(pos)
        b.seq_slots = _ptr(slots)
        b.query_start = _ptr(qs)
        b.logits_rows = _ptr(rows)
        b.num_logits = n_rows
        b.logits = out_ptr
        b.logits_dtype = out_code
        self._call(self._lib.dsv4_forward, ctypes.byref(b), self._stream(stream))
        if logits is not None:
            return logits
        return _torch.from_numpy(out) if torch_io else out

    def _numpy_logits(self, out, rows: int) -> int | None:
        if not isinstance(out, np.ndarray):
            raise invalid(f"logits must be a numpy array or a torch tensor, got {type(out).__name__}")
        if out.dtype != np.float32:
            raise invalid(f"logits has dtype {out.dtype}, must be float32 (bf16 output: pass a torch tensor)")
        if out.shape != (rows, self.vocab_size):
            raise invalid(f"logits has shape {out.shape}, must be [num_logits, vocab_size] = "
                          f"[{rows}, {self.vocab_size}]")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise invalid("logits must be C-contiguous and writeable")
        return out.ctypes.data if out.size else None

    def _forward_device(self, token_ids, positions, seq_slots, query_start, logits_rows, stream, logits):
        arrays = (token_ids, positions, seq_slots, query_start, logits_rows)
        if not any(_torch.is_tensor(a) for a in arrays):
            # dsv4_forward on a CUDA engine reads device pointers; numpy arrays live on the host.
            raise _lib.error_for(
                11, "forward with numpy arrays needs a CPU engine: a CUDA engine reads batch buffers "
                    f"from device memory (pass int32 torch tensors on cuda:{self._device}, or device "
                    "pointers through the C ABI)")
        dev = self._device
        tok = _torch.device_int32(token_ids, "token_ids", dev)
        pos = _torch.device_int32(positions, "positions", dev)
        slots = _torch.device_int32(seq_slots, "seq_slots", dev)
        qs = _torch.device_int32(query_start, "query_start", dev)
        rows = None if logits_rows is None else _torch.device_int32(logits_rows, "logits_rows", dev)
        # Only host-side metadata (shapes) is checked here: reading values would synchronize.
        n_tok, n_seq = tok.shape[0], slots.shape[0]
        if pos.shape[0] != n_tok:
            raise invalid(f"positions has {pos.shape[0]} entries, token_ids {n_tok}")
        if qs.shape[0] != n_seq + 1:
            raise invalid(f"query_start has {qs.shape[0]} entries, expected len(seq_slots) + 1 = {n_seq + 1}")
        n_rows = n_tok if rows is None else rows.shape[0]
        if logits is None:
            logits = _torch.empty_logits(n_rows, self.vocab_size, tok)
        out_code = _torch.logits_code(logits, n_rows, self.vocab_size, dev)
        b = self._lib.dsv4_batch_default()
        b.num_tokens = n_tok
        b.num_seqs = n_seq
        b.token_ids = tok.data_ptr()
        b.positions = pos.data_ptr()
        b.seq_slots = slots.data_ptr()
        b.query_start = qs.data_ptr()
        b.logits_rows = None if rows is None else rows.data_ptr()
        b.num_logits = n_rows
        b.logits = logits.data_ptr() if logits.numel() else None
        b.logits_dtype = out_code
        self._call(self._lib.dsv4_forward, ctypes.byref(b), self._stream(stream, torch_inputs=True))
        return logits

    def release(self, slot: int) -> None:
        """Forgets the state of sequence slot ``slot``."""
        self._call(self._lib.dsv4_release_slot, int(slot))

    def refit(self, name: str, array, dtype: str | None = None, stream=None) -> None:
        """Replaces one weight in place (after finalize). See :meth:`refit_many`."""
        self.refit_many({name: array}, dtype=dtype, stream=stream)

    def load_tensors(self, tensors: Mapping[str, object] | Iterable[tuple], dtype: str | None = None,
                     stream=None) -> None:
        """Loads several weights before :meth:`finalize` (``dsv4_load_tensors``, ABI minor 4):
        all validated before any is written; a stored-format weight comes with its scale entry
        in the same call. Entries as for :meth:`refit_many`; CUDA torch tensors are written on
        the device without a host copy."""
        self._send(self._lib.dsv4_load_tensors, tensors, dtype, stream)

    def refit_many(self, tensors: Mapping[str, object] | Iterable[tuple], dtype: str | None = None,
                   stream=None) -> None:
        """Replaces several weights at once: all are validated before any is written, so
        an error leaves the engine unchanged.

        ``tensors``: ``{name: value}`` or ``[(name, value), ...]``; a value is a numpy array,
        a torch tensor, or ``(value, dtype)`` giving that entry its own dtype (a quantized
        weight and its scale differ). ``dtype`` (default for every entry): None = from the
        value (numpy float32/float16/int32/int64, float64 -> float32; torch float32, bfloat16,
        float16, int32, int64, float8_e4m3fn, float8_e8m0fnu, float4_e2m1fn_x2); "bf16"
        (float values rounded to nearest even, or uint16 bit patterns); "fp8_e4m3", "e8m0"
        (uint8 codes / scale bytes) and "fp4_e2m1" (packed uint8/int8 [..., cols/2], sent
        with the logical shape [..., cols]). FP8/FP4/E8M0 need ABI minor >= 1; a quantized
        weight's block scale is its own entry (e.g. ``layers.0.attn.wq_a.scale``, E8M0 or F32),
        in the same call, or inside :meth:`refitting` in any call of it (see there).

        torch tensors: CPU ones are host memory (made contiguous / converted on the host if
        needed); CUDA ones are device memory, read in place, so they must be contiguous, on
        the engine's device and already of the stored dtype (no hidden device copies:
        InvalidArgumentError otherwise). ``stream``: int, torch.cuda.Stream, or None = torch's
        current stream when any value is a torch tensor (else the legacy default stream).
        The call returns after the copies are done: the tensors may be freed afterwards.
        """
        self._send(self._lib.dsv4_refit, tensors, dtype, stream)

    def _send(self, fn, tensors, dtype, stream) -> None:
        """Calls ``fn(engine, entries, n, stream)`` (dsv4_refit / dsv4_load_tensors)."""
        if isinstance(tensors, Mapping):
            items = [(n, *_split_entry(v, dtype)) for n, v in tensors.items()]
        else:
            items = []
            for item in tensors:
                if not isinstance(item, tuple) or len(item) not in (2, 3):
                    raise invalid(f"refit entries must be (name, value) or (name, value, dtype), got {item!r:.80}")
                if len(item) == 3:
                    items.append(item)
                else:
                    items.append((item[0], *_split_entry(item[1], dtype)))
        arr = (_lib.Tensor * max(len(items), 1))()
        keep = []
        torch_inputs = False
        for k, (name, value, entry_dtype) in enumerate(items):
            t, kept, is_torch = _tensor_entry(name, value, entry_dtype, self._device)
            arr[k] = t
            keep.append(kept)
            torch_inputs |= is_torch
        self._call(fn, arr, len(items), self._stream(stream, torch_inputs))
        del keep

    def refit_begin(self) -> None:
        """Opens a chunked refit: refit/refit_many calls follow, forward raises StateError
        until refit_end rebuilds the derived buffers once."""
        self._call(self._lib.dsv4_refit_begin)

    def refit_end(self, stream=None) -> None:
        """Closes a chunked refit (rebuilds derived buffers; the engine is ready again).
        ``stream``: None (legacy default stream), an int CUstream or a torch.cuda.Stream."""
        self._call(self._lib.dsv4_refit_end, self._stream(stream))

    @contextlib.contextmanager
    def refitting(self, stream=None):
        """``with engine.refitting(): engine.refit(...); ...`` — begin, chunks, end.
        ``stream`` is refit_end's.

        Inside, a quantized weight (fp8_e4m3 / fp4_e2m1 codes) and its block scale may come
        in different refit calls, in either order (e.g. one checkpoint shard per call): the
        first is checked alone and kept (a host copy) until the other arrives. If one still
        lacks its partner at the end, refit_end raises TensorError naming every such entry
        and the engine stays refitting: send the missing entries, then call
        :meth:`refit_end` again.

        If the body raises, the refit is aborted (:meth:`refit_abort`) and the exception
        propagates: the engine is ready, with the chunks written so far."""
        self.refit_begin()
        try:
            yield self
        except BaseException:
            self.refit_abort(stream)
            raise
        self.refit_end(stream)

    def refit_abort(self, stream=None) -> None:
        """Ends an open chunked refit without completing it: the chunks already written stay
        written, halves held for their partner are dropped, derived buffers are rebuilt and
        the engine is ready (``dsv4_refit_abort``). ``stream`` as for :meth:`refit_end`."""
        self._call(self._lib.dsv4_refit_abort, self._stream(stream))

    def slot_length(self, slot: int, stream=None) -> int:
        """Positions sequence slot ``slot`` holds now (0 if unused or released). On CUDA it
        reads the device's copy after the work on ``stream`` has run (it blocks the host)."""
        n = ctypes.c_int32(-1)
        self._call(self._lib.dsv4_slot_length, int(slot), self._stream(stream), ctypes.byref(n))
        return n.value

    # -- bad batches on CUDA -------------------------------------------------------------

    def device_error(self, stream=None) -> "BatchFault | None":
        """Returns and clears the first fault of a bad batch since the last call, or None.

        On a CUDA engine ``forward`` cannot see the batch's device values: a bad one changes
        no slot, fills its logits with NaN and leaves its first fault in a sticky device
        record, which this reads after the work on ``stream`` (default: the legacy default
        stream; pass the forward's stream, e.g. torch's current one) has run. It syncs that
        stream, so never call it inside a graph capture. Always None on the CPU backend,
        whose ``forward`` raises for a bad batch."""
        if _lib.abi_minor() < _lib.ABI_MINOR_DEVICE_ERROR:
            return None
        rec = _lib.BatchFault()
        with self._lock:
            status = self._lib.dsv4_device_error(self._h(), self._stream(stream), ctypes.byref(rec))
            message = _lib.last_error()
        if status == _lib.STATUS_OK:
            return None
        if rec.status != status:  # the call itself failed (e.g. a CUDA error)
            _lib.check(status)
        return BatchFault(
            status=_errors.STATUS_NAMES.get(rec.status, str(rec.status)),
            field=_lib.FIELD_NAMES.get(rec.field, str(rec.field)),
            index=rec.index,
            value=rec.value,
            rule=_lib.RULE_NAMES.get(rec.rule, str(rec.rule)),
            expected=rec.expected,
            seq=rec.seq,
            slot=rec.slot,
            message=message.split(": ", 1)[-1],
        )

    # -- introspection ------------------------------------------------------------------

    def info(self) -> dict:
        """Config, capacities in effect and phase. With ABI minor >= 1 also the device
        address ranges of the engine's fixed buffers: ``weights_base``/``_nbytes``,
        ``derived_*``, ``state_*``, ``workspace_*`` (ints; 0 on the CPU backend)."""
        i = _lib.Info()
        i.struct_size = ctypes.sizeof(_lib.Info)  # an older library writes only its prefix
        self._call(self._lib.dsv4_get_info, ctypes.byref(i))
        absent = _lib.INFO_FIELDS_MINOR1 if _lib.abi_minor() < _lib.ABI_MINOR_STORED_FORMATS else ()
        if _lib.abi_minor() < _lib.ABI_MINOR_DEVICE_ERROR:
            absent += _lib.INFO_FIELDS_MINOR2
        d = {name: getattr(i, name) for name, _ in _lib.Info._fields_
             if name != "struct_size" and name not in absent}
        for name in _lib.INFO_FIELDS_MINOR1 + _lib.INFO_FIELDS_MINOR2:
            if name in d and d[name] is None:  # c_void_p reads NULL as None
                d[name] = 0
        d["phase"] = _lib.PHASES.get(i.phase, str(i.phase))
        d["numerics"] = {v: k for k, v in _lib.NUMERICS.items()}.get(i.numerics, i.numerics)
        d["weight_format"] = {v: k for k, v in _lib.WEIGHT_FORMAT.items()}.get(i.weight_format, i.weight_format)
        d["device"] = "cpu" if i.device == _lib.DEVICE_CPU else f"cuda:{i.device}"
        return d

    def weights(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """Every source weight (loadable and refittable by name) as ``(name, dtype, shape,
        data pointer)``; pointers are stable. Derived tensors are left out: see weight_descs."""
        return [(d["name"], d["dtype"], d["shape"], d["data"]) for d in self.weight_descs() if not d["derived"]]

    def weight_descs(self) -> list[dict]:
        """Every tensor of the engine, source weights first, then derived ones (ABI minor
        >= 1), as dicts: ``name``, ``dtype`` (storage: "f32", "bf16", "f8_e4m3", ...),
        ``shape`` (logical), ``data`` (address, fixed from create to destroy), ``nbytes``,
        ``derived`` (bool: rebuilt by finalize/refit, not refittable), ``device`` ("cpu" or
        "cuda:N"), ``scale`` / ``scale_nbytes`` / ``scale_block`` (f32 block scales of a
        quantized weight; 0 / 0 / (0, 0) otherwise)."""
        out = []
        for w in self._weight_descs():
            out.append({
                "name": w.name.decode(),
                "dtype": _lib.DTYPE_NAMES.get(w.dtype, str(w.dtype)),
                "shape": tuple(w.shape[: w.ndim]),
                "data": w.data or 0,
                "nbytes": w.nbytes,
                "derived": bool(w.derived),
                "device": "cpu" if w.device == _lib.DEVICE_CPU else f"cuda:{w.device}",
                "scale": w.scale or 0,
                "scale_nbytes": w.scale_nbytes,
                "scale_block": tuple(w.scale_block),
            })
        return out

    def _weight_descs(self) -> list:
        n = ctypes.c_size_t()
        self._call(self._lib.dsv4_weight_count, ctypes.byref(n))
        out = []
        for i in range(n.value):
            w = _lib.WeightDesc()
            w.struct_size = ctypes.sizeof(_lib.WeightDesc)
            self._call(self._lib.dsv4_weight_info, i, ctypes.byref(w))
            out.append(w)
        return out

    def _host_desc(self, name: str):
        for w in self._weight_descs():
            if w.name.decode() == name:
                if w.device != _lib.DEVICE_CPU:
                    raise _lib.error_for(11, f"weight `{name}` lives on the device")
                return w
        raise _lib.error_for(7, f"no weight `{name}`")

    def weight_array(self, name: str) -> np.ndarray:
        """A numpy copy of one host-resident tensor (source or derived; tests, debugging).
        BF16 storage comes back as uint16 bit patterns, FP8 codes as uint8 of the logical
        shape, FP4 codes as packed uint8 [..., cols/2] (scales: :meth:`weight_scales`)."""
        w = self._host_desc(name)
        np_dtype = _STORAGE_NP.get(w.dtype)
        if np_dtype is None:
            raise _lib.error_for(11, f"weight `{name}`: storage dtype {w.dtype} is not readable here")
        shape = tuple(w.shape[: w.ndim])
        if w.dtype == _lib.DTYPE_FP4_E2M1 and shape:
            shape = shape[:-1] + (shape[-1] // 2,)
        if not w.nbytes or not w.data:
            return np.zeros(shape, dtype=np_dtype)
        buf = (ctypes.c_char * w.nbytes).from_address(w.data)
        return np.frombuffer(bytes(buf), dtype=np_dtype).reshape(shape)

    def weight_scales(self, name: str) -> np.ndarray:
        """A numpy copy of a host-resident quantized weight's f32 block scales, shaped as the
        block grid ``[ceil(rows / block_rows), ceil(cols / block_cols)]`` (flat if not 2-D)."""
        w = self._host_desc(name)
        if not w.scale:
            raise _lib.error_for(7, f"weight `{name}` has no block scales (dtype {_lib.DTYPE_NAMES.get(w.dtype)})")
        buf = (ctypes.c_char * w.scale_nbytes).from_address(w.scale)
        s = np.frombuffer(bytes(buf), dtype=np.float32)
        shape, (br, bc) = tuple(w.shape[: w.ndim]), tuple(w.scale_block)
        if len(shape) == 2 and br > 0 and bc > 0:
            grid = (-(-shape[0] // br), -(-shape[1] // bc))
            if grid[0] * grid[1] == s.size:
                return s.reshape(grid)
        return s

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Destroys the engine; later calls raise StateError. Idempotent."""
        with self._lock:
            if self._handle is not None:
                self._lib.dsv4_destroy(self._handle)
                self._handle = None

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._handle is None:
            return "<dsv4.Engine closed>"
        i = self.info()
        return f"<dsv4.Engine {i['device']} vocab={i['vocab_size']} layers={i['num_layers']} {i['phase']}>"

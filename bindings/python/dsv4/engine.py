"""``dsv4.Engine``: one model on one device, over the C ABI (numpy in, numpy out)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterable, Mapping

import numpy as np

from . import _lib
from ._errors import invalid

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

# numpy dtype -> DSV4_DTYPE_*
_NP_DTYPES = {
    np.dtype(np.float32): _lib.DTYPE_F32,
    np.dtype(np.float16): _lib.DTYPE_F16,
    np.dtype(np.int32): _lib.DTYPE_I32,
    np.dtype(np.int64): _lib.DTYPE_I64,
}
_STORAGE_NP = {_lib.DTYPE_F32: np.float32, _lib.DTYPE_I32: np.int32, _lib.DTYPE_F16: np.float16,
               _lib.DTYPE_I64: np.int64, _lib.DTYPE_BF16: np.uint16}


def _device_ordinal(device) -> int:
    if isinstance(device, int):
        return device
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


def _host_tensor(name: str, array, dtype: str | None):
    """(Tensor struct, kept-alive objects) for one named host array."""
    if not isinstance(name, str) or not name:
        raise invalid(f"weight name must be a non-empty str, got {name!r}")
    a = np.asarray(array)
    if dtype is not None and str(dtype).lower() in ("bf16", "bfloat16"):
        if a.dtype.name == "bfloat16" or a.dtype == np.uint16:
            a = np.ascontiguousarray(a).view(np.uint16)
        elif np.issubdtype(a.dtype, np.floating):
            f = np.ascontiguousarray(a, dtype=np.float32)
            bits = f.view(np.uint32).astype(np.uint64)
            a = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        else:
            raise invalid(f"weight `{name}`: cannot use dtype {a.dtype} as bf16")
        code = _lib.DTYPE_BF16
    elif a.dtype.name == "bfloat16":  # ml_dtypes / jax bfloat16 arrays
        a = np.ascontiguousarray(a).view(np.uint16)
        code = _lib.DTYPE_BF16
    else:
        if dtype is not None:
            a = a.astype(np.dtype(dtype), copy=False)
        elif a.dtype == np.float64:
            a = a.astype(np.float32)
        if a.dtype not in _NP_DTYPES:
            raise invalid(f"weight `{name}`: unsupported dtype {a.dtype} (use float32, float16, bf16, int32, int64)")
        code = _NP_DTYPES[a.dtype]
    a = np.ascontiguousarray(a)
    if a.ndim > _lib.MAX_DIMS:
        raise invalid(f"weight `{name}`: {a.ndim} dimensions (at most {_lib.MAX_DIMS})")
    bname = name.encode("utf-8")
    t = _lib.lib().dsv4_tensor_default()
    t.name = bname
    t.dtype = code
    t.ndim = a.ndim
    for k, d in enumerate(a.shape):
        t.shape[k] = d
    t.data = a.ctypes.data if a.size else None
    t.memory = _lib.MEMORY_HOST
    return t, (a, bname)


class Engine:
    """A dsv4 engine: create + load + finalize in the constructor.

    ``model_dir`` is a checkpoint directory holding config.json (and the weights for
    ``load="auto"``). ``model_dir=None`` with ``load="dummy"`` uses the embedded tiny demo
    model. ``config_json`` (text) overrides the config source. ``load=None`` only creates
    the engine: stream weights with :meth:`load_tensor` and call :meth:`finalize`.

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
    ):
        self._handle = None
        self._lock = threading.RLock()
        lib = _lib.lib()
        self._lib = lib
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
        self._device = p.device
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

    # -- lifecycle ----------------------------------------------------------------------

    def load_tensor(self, name: str, array, dtype: str | None = None) -> None:
        """Loads one weight from host memory (before finalize)."""
        t, keep = _host_tensor(name, array, dtype)
        self._call(self._lib.dsv4_load_tensor, ctypes.byref(t))
        del keep

    def finalize(self, stream: int | None = None) -> None:
        """Rebuilds derived tensors and makes the engine runnable (idempotent)."""
        self._call(self._lib.dsv4_finalize, stream)

    def forward(self, token_ids, positions, seq_slots, query_start, logits_rows=None,
                stream: int | None = None) -> np.ndarray:
        """Runs one batch; returns float32 logits ``[len(logits_rows) or num_tokens, vocab]``.

        ``token_ids``/``positions``: per token; ``seq_slots``: per sequence;
        ``query_start``: ``num_seqs + 1`` offsets; ``logits_rows``: token rows that produce
        logits (None = all).
        """
        if self._device != _lib.DEVICE_CPU:
            # dsv4_forward on a CUDA engine reads device pointers; numpy arrays live on the host.
            raise _lib.error_for(
                11, "forward with numpy arrays needs a CPU engine: a CUDA engine reads batch buffers "
                    "from device memory (pass device pointers through the C ABI)")
        tok = _int32_array(token_ids, "token_ids")
        pos = _int32_array(positions, "positions")
        slots = _int32_array(seq_slots, "seq_slots")
        qs = _int32_array(query_start, "query_start")
        rows = None if logits_rows is None else _int32_array(logits_rows, "logits_rows")
        if len(pos) != len(tok):
            raise invalid(f"positions has {len(pos)} entries, token_ids {len(tok)}")
        if len(qs) != len(slots) + 1:
            raise invalid(f"query_start has {len(qs)} entries, expected len(seq_slots) + 1 = {len(slots) + 1}")
        n_rows = len(tok) if rows is None else len(rows)
        out = np.empty((n_rows, self.vocab_size), dtype=np.float32)
        b = self._lib.dsv4_batch_default()
        b.num_tokens = len(tok)
        b.num_seqs = len(slots)
        b.token_ids = _ptr(tok)
        b.positions = _ptr(pos)
        b.seq_slots = _ptr(slots)
        b.query_start = _ptr(qs)
        b.logits_rows = _ptr(rows)
        b.num_logits = n_rows
        b.logits = out.ctypes.data if out.size else None
        b.logits_dtype = _lib.LOGITS_F32
        self._call(self._lib.dsv4_forward, ctypes.byref(b), stream)
        return out

    def release(self, slot: int) -> None:
        """Forgets the state of sequence slot ``slot``."""
        self._call(self._lib.dsv4_release_slot, int(slot))

    def refit(self, name: str, array, dtype: str | None = None, stream: int | None = None) -> None:
        """Replaces one weight in place (after finalize). See :meth:`refit_many`."""
        self.refit_many({name: array}, dtype=dtype, stream=stream)

    def refit_many(self, tensors: Mapping[str, object] | Iterable[tuple[str, object]],
                   dtype: str | None = None, stream: int | None = None) -> None:
        """Replaces several weights at once: all are validated before any is written, so
        an error leaves the engine unchanged. Arrays may be float32/float16/int32/int64,
        bf16 (``dtype="bf16"`` with float or uint16 bit arrays, or ml_dtypes bfloat16)."""
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        arr = (_lib.Tensor * max(len(items), 1))()
        keep = []
        for k, (name, a) in enumerate(items):
            t, kept = _host_tensor(name, a, dtype)
            arr[k] = t
            keep.append(kept)
        self._call(self._lib.dsv4_refit, arr, len(items), stream)
        del keep

    def refit_begin(self) -> None:
        """Opens a chunked refit: refit/refit_many calls follow, forward raises StateError
        until refit_end rebuilds the derived buffers once."""
        self._call(self._lib.dsv4_refit_begin)

    def refit_end(self, stream: int | None = None) -> None:
        """Closes a chunked refit (rebuilds derived buffers; the engine is ready again)."""
        self._call(self._lib.dsv4_refit_end, stream)

    @contextlib.contextmanager
    def refitting(self, stream: int | None = None):
        """``with engine.refitting(): engine.refit(...); ...`` — begin, chunks, end."""
        self.refit_begin()
        yield self
        self.refit_end(stream)

    # -- introspection ------------------------------------------------------------------

    def info(self) -> dict:
        """Config, capacities in effect and phase."""
        i = _lib.Info()
        i.struct_size = ctypes.sizeof(_lib.Info)
        self._call(self._lib.dsv4_get_info, ctypes.byref(i))
        d = {name: getattr(i, name) for name, _ in _lib.Info._fields_ if name != "struct_size"}
        d["phase"] = _lib.PHASES.get(i.phase, str(i.phase))
        d["numerics"] = {v: k for k, v in _lib.NUMERICS.items()}.get(i.numerics, i.numerics)
        d["weight_format"] = {v: k for k, v in _lib.WEIGHT_FORMAT.items()}.get(i.weight_format, i.weight_format)
        d["device"] = "cpu" if i.device == _lib.DEVICE_CPU else f"cuda:{i.device}"
        return d

    def weights(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """Every weight as ``(name, dtype, shape, data pointer)``; pointers are stable."""
        return [(w.name.decode(), _lib.DTYPE_NAMES.get(w.dtype, str(w.dtype)), tuple(w.shape[: w.ndim]), w.data or 0)
                for w in self._weight_descs()]

    def weight_array(self, name: str) -> np.ndarray:
        """A read-only numpy copy of one host-resident weight (tests, debugging)."""
        for w in self._weight_descs():
            if w.name.decode() == name:
                if w.device != _lib.DEVICE_CPU:
                    raise _lib.error_for(11, f"weight `{name}` lives on the device")
                np_dtype = _STORAGE_NP[w.dtype]
                buf = (ctypes.c_char * w.nbytes).from_address(w.data)
                return np.frombuffer(bytes(buf), dtype=np_dtype).reshape(tuple(w.shape[: w.ndim]))
        raise _lib.error_for(7, f"no weight `{name}`")

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

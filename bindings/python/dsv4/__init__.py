"""dsv4: DeepSeek-V4 inference engine, Python binding over its C ABI (ctypes + numpy).

    import dsv4
    with dsv4.Engine(load="dummy", max_seq_len=256) as eng:   # embedded tiny model
        logits = eng.forward(token_ids=[1, 2, 3], positions=[0, 1, 2],
                             seq_slots=[0], query_start=[0, 3])
        print(logits.shape)                                   # (3, vocab_size)

torch tensors work too (torch is optional and imported only by the caller): a CUDA engine
takes int32 CUDA tensors and a caller-owned ``logits=`` tensor, runs on torch's current stream
and can be captured with ``torch.cuda.graph``; refit/load_tensor take CPU or CUDA tensors:

    eng = dsv4.Engine("ckpt/", device="cuda:0")
    ids, pos = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda"), ...
    out = torch.empty(3, eng.vocab_size, device="cuda")
    eng.forward(ids, pos, slots, qstart, logits=out)          # no allocation, no sync
    eng.refit_many({"layers.0.attn.wq_a.weight": codes_fp8,   # torch.float8_e4m3fn
                    "layers.0.attn.wq_a.scale": scale_e8m0})  # torch.float8_e8m0fnu

Install with ``pip install ./bindings/python`` (or ``pip install -e``). The shared library is
found via ``$DSV4_LIBRARY``, else inside this package's directory, else
``$CARGO_TARGET_DIR/{release,debug}``, else ``target/{release,debug}`` of the dsv4 checkout above
the package; ``dsv4.library_path()`` says which file was loaded and how it was found.
Errors raise :class:`Error` (one subclass per status) with ``.status`` and ``.message``.
"""

from __future__ import annotations

from . import _lib
from ._lib import LibraryPath
from ._errors import (
    CapacityError,
    ConfigError,
    CudaError,
    Error,
    FormatError,
    InternalError,
    OutOfMemoryError,
    InvalidArgumentError,
    IoError,
    NoDeviceError,
    NullPointerError,
    StateError,
    TensorError,
    UnsupportedError,
)
from ._lib import PAD_SLOT
from .engine import BatchFault, Engine, plan_memory

__all__ = [
    "Engine",
    "plan_memory",
    "BatchFault",
    "PAD_SLOT",
    "LibraryPath",
    "Error",
    "InvalidArgumentError",
    "NullPointerError",
    "StateError",
    "ConfigError",
    "IoError",
    "FormatError",
    "TensorError",
    "CapacityError",
    "NoDeviceError",
    "CudaError",
    "UnsupportedError",
    "InternalError",
    "OutOfMemoryError",
    "abi_version",
    "version",
    "library_path",
    "set_log_callback",
]


def abi_version() -> tuple[int, int]:
    """(major, minor) ABI version of the loaded library."""
    v = _lib.lib().dsv4_abi_version()
    return v >> 16, v & 0xFFFF


def version() -> str:
    """Version string of the loaded library, e.g. ``"dsv4 0.1.0 (abi 1.0)"``."""
    return _lib.lib().dsv4_version_string().decode()


def library_path() -> LibraryPath:
    """The loaded shared library (loading it if needed): ``(path, how)``, where ``how`` says how
    it was found: ``"DSV4_LIBRARY"``, ``"package"`` (inside this package's directory),
    ``"CARGO_TARGET_DIR"`` or ``"checkout"`` (``target/{release,debug}`` of the dsv4 checkout
    above the package). ``os.fspath()`` of it is the path. Raises IoError naming every place
    tried when the library is not found."""
    return _lib.lib().dsv4_location


_log_callback = None  # keeps the ctypes trampoline alive while installed


def set_log_callback(fn=None, level: str = "warn") -> None:
    """Routes the library's log lines to ``fn(level: str, message: str)`` (None = stderr).

    ``level`` ("error", "warn", "info", "debug") is the most verbose level delivered.
    ``fn`` may be called from library worker threads; exceptions it raises are printed
    and swallowed (they cannot cross the C boundary).
    """
    global _log_callback
    lib = _lib.lib()
    code = _lib.LOG_LEVELS.get(str(level).lower())
    if code is None:
        raise _lib.error_for(1, f"level must be one of {sorted(_lib.LOG_LEVELS)}, got {level!r}")
    names = {v: k for k, v in _lib.LOG_LEVELS.items()}
    if fn is None:
        cb = _lib.LOG_CALLBACK()
    else:
        def trampoline(lvl, msg, _user):
            try:
                fn(names.get(lvl, str(lvl)), msg.decode("utf-8", "replace") if msg else "")
            except Exception:  # never propagate into the library
                import traceback

                traceback.print_exc()

        cb = _lib.LOG_CALLBACK(trampoline)
    _lib.check(lib.dsv4_set_log_callback(cb, None, code))
    _log_callback = cb if fn is not None else None

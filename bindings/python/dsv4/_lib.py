"""ctypes view of include/dsv4.h: locating the library, struct layouts, prototypes.

The library is found, in order, at ``$DSV4_LIBRARY``; inside this package's directory
(``dsv4/libdsv4.so``, e.g. site-packages/dsv4/ of an installed package);
``$CARGO_TARGET_DIR/{release,debug}``; and ``target/{release,debug}/libdsv4.so`` of the dsv4
checkout found by walking up from the package (an editable install or the source tree; a
package installed elsewhere has none). It is loaded on first use, so ``import dsv4`` works
without it; :func:`find` searches without loading.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Mapping
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import NamedTuple

from ._errors import Error, error_for

# The oldest ABI this binding works with (include/dsv4.h): dsv4_create_params is passed by
# value from dsv4_create_params_default(), so its layout (minor 2 appended `kernel_set`, minor
# 4 `staging_nbytes`) must be the library's; the function table below names every call of the
# newest minor.
ABI_MAJOR = 1
ABI_MINOR = 4
# Minor 1 added: FP8/FP4/E8M0 tensor entries (stored-format load and refit), DEVICE memory
# for tensor entries on the CUDA backend, the buffer ranges at the end of dsv4_info, and
# derived tensors in the weight listing.
ABI_MINOR_STORED_FORMATS = 1
# Minor 2 added: DSV4_PAD_SLOT padding sequences, the device error record (dsv4_device_error,
# dsv4_info.device_error).
ABI_MINOR_DEVICE_ERROR = 2
# Minor 3 added: dsv4_refit_abort, the memory plan (dsv4_plan_memory), dsv4_slot_length,
# dsv4_canonical_name, bos/eos and per-slot state bytes in dsv4_info, DSV4_STATUS_OUT_OF_MEMORY.
ABI_MINOR_REFIT_ABORT = 3
# Minor 4 added: `staging_nbytes` (create), `host_transient_nbytes` (dsv4_info); the CUDA
# backend keeps no host copy of the weights.
ABI_MINOR_STAGING = 4

MAX_DIMS = 8

STATUS_OK = 0

DEVICE_CPU = -1
NUMERICS = {"exact": 0, "official": 1}
WEIGHT_FORMAT = {"as_stored": 0, "bf16": 1, "quantize": 2}
LOAD = {"auto": 0, "safetensors": 1, "dummy": 2}
DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I32, DTYPE_I64 = 0, 1, 2, 3, 4
# Quantized types: reported by dsv4_weight_info (codes + f32 block scales at `scale`) and,
# from ABI minor 1, accepted in tensor entries (codes, with the block scale as a separate
# entry of dtype E8M0 or F32). FP4 entries carry the logical shape (two codes per byte).
DTYPE_F8_E4M3, DTYPE_FP4_E2M1, DTYPE_E8M0 = 5, 6, 7
# Reported by dsv4_weight_info for derived tensors only (layer 0's folded mHC projection).
DTYPE_F64 = 8
# Every DSV4_DTYPE_* (8, f64, only for derived tensors in the weight listing).
DTYPE_NAMES = {0: "f32", 1: "bf16", 2: "f16", 3: "i32", 4: "i64", 5: "f8_e4m3", 6: "fp4_e2m1", 7: "e8m0", 8: "f64"}
# Explicit `dtype=` strings for stored formats that numpy/torch cannot name by themselves.
STORED_DTYPES = {
    "bf16": DTYPE_BF16, "bfloat16": DTYPE_BF16,
    "fp8_e4m3": DTYPE_F8_E4M3, "f8_e4m3": DTYPE_F8_E4M3, "float8_e4m3fn": DTYPE_F8_E4M3,
    "fp4_e2m1": DTYPE_FP4_E2M1, "fp4": DTYPE_FP4_E2M1, "float4_e2m1fn_x2": DTYPE_FP4_E2M1,
    "e8m0": DTYPE_E8M0, "ue8m0": DTYPE_E8M0, "f8_e8m0": DTYPE_E8M0, "float8_e8m0fnu": DTYPE_E8M0,
}
MEMORY_HOST, MEMORY_DEVICE = 0, 1
LOGITS_F32, LOGITS_BF16 = 0, 1
# seq_slots value of a padding sequence (reads and writes no state; its logits rows are zeros).
PAD_SLOT = -1
# dsv4_batch_fault.field / .rule codes.
FIELD_NAMES = {1: "token_ids", 2: "positions", 3: "seq_slots", 4: "query_start", 5: "logits_rows"}
RULE_NAMES = {1: "range", 2: "duplicate", 3: "not_increasing", 4: "endpoint",
              5: "not_consecutive", 6: "not_continuing"}
PHASES = {0: "created", 1: "loaded", 2: "ready", 3: "refitting"}
LOG_LEVELS = {"error": 0, "warn": 1, "info": 2, "debug": 3}


class CreateParams(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("config_path", c_char_p),
        ("config_json", c_char_p),
        ("use_tiny_default", c_int32),
        ("device", c_int32),
        ("max_num_seqs", c_int32),
        ("max_num_tokens", c_int32),
        ("max_seq_len", c_int32),
        ("num_threads", c_int32),
        ("numerics", c_int32),
        ("weight_format", c_int32),
        ("cache_dir", c_char_p),
        # ABI minor 2.
        ("kernel_set", c_char_p),
        # ABI minor 4.
        ("staging_nbytes", c_uint64),
    ]


class Tensor(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("data", c_void_p),
        ("memory", c_int32),
    ]


class Batch(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_tokens", c_int32),
        ("num_seqs", c_int32),
        ("token_ids", c_void_p),
        ("positions", c_void_p),
        ("seq_slots", c_void_p),
        ("query_start", c_void_p),
        ("logits_rows", c_void_p),
        ("num_logits", c_int32),
        ("logits", c_void_p),
        ("logits_dtype", c_int32),
    ]


class Info(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("vocab_size", c_int32),
        ("hidden_size", c_int32),
        ("num_layers", c_int32),
        ("num_heads", c_int32),
        ("head_dim", c_int32),
        ("hc_mult", c_int32),
        ("n_routed_experts", c_int32),
        ("experts_per_tok", c_int32),
        ("max_num_seqs", c_int32),
        ("max_num_tokens", c_int32),
        ("max_seq_len", c_int32),
        ("device", c_int32),
        ("numerics", c_int32),
        ("weight_format", c_int32),
        ("phase", c_int32),
        ("num_weights", c_size_t),
        # ABI minor 1: device address ranges of the engine's fixed buffers (CUDA backend;
        # NULL/0 on the CPU). An older library leaves these bytes as we set them (zero).
        ("weights_base", c_void_p),
        ("weights_nbytes", c_uint64),
        ("derived_base", c_void_p),
        ("derived_nbytes", c_uint64),
        ("state_base", c_void_p),
        ("state_nbytes", c_uint64),
        ("workspace_base", c_void_p),
        ("workspace_nbytes", c_uint64),
        # ABI minor 2: device address of the error record (CUDA; NULL on the CPU).
        ("device_error", c_void_p),
        # ABI minor 3: the config's token ids.
        ("bos_token_id", c_int64),
        ("eos_token_id", c_int64),
        ("state_slot_nbytes", c_uint64),
        ("device_nbytes", c_uint64),
        ("host_nbytes", c_uint64),
        # ABI minor 4: host bytes held now beyond the fixed buffers (CUDA staging while a
        # load or refit writes, held refit halves).
        ("host_transient_nbytes", c_uint64),
    ]


# Fields of Info that a library older than ABI minor 1 does not write.
INFO_FIELDS_MINOR1 = (
    "weights_base", "weights_nbytes", "derived_base", "derived_nbytes",
    "state_base", "state_nbytes", "workspace_base", "workspace_nbytes",
)
# Fields of Info that a library older than ABI minor 2 does not write.
INFO_FIELDS_MINOR2 = ("device_error",)


class MemoryPlan(Structure):
    """dsv4_memory_plan (ABI minor 3): an engine's memory by kind (dsv4_plan_memory)."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("weights_nbytes", c_uint64),
        ("derived_nbytes", c_uint64),
        ("state_nbytes", c_uint64),
        ("state_slot_nbytes", c_uint64),
        ("workspace_nbytes", c_uint64),
        ("device_nbytes", c_uint64),
        ("host_nbytes", c_uint64),
    ]


class BatchFault(Structure):
    """dsv4_batch_fault: the first fault of a bad batch on a CUDA engine."""

    _fields_ = [
        ("status", c_int32),
        ("field", c_int32),
        ("index", c_int32),
        ("value", c_int32),
        ("rule", c_int32),
        ("expected", c_int32),
        ("seq", c_int32),
        ("slot", c_int32),
    ]


class WeightDesc(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("data", c_void_p),
        ("nbytes", c_uint64),
        ("derived", c_int32),
        ("device", c_int32),
        ("scale", c_void_p),
        ("scale_nbytes", c_uint64),
        ("scale_block", c_int32 * 2),
    ]


LOG_CALLBACK = CFUNCTYPE(None, c_int32, c_char_p, c_void_p)

_status = c_int32
_engine_p = c_void_p

_PROTOTYPES = {
    "dsv4_abi_version": (c_uint32, []),
    "dsv4_version_string": (c_char_p, []),
    "dsv4_last_error": (c_char_p, []),
    "dsv4_status_name": (c_char_p, [_status]),
    "dsv4_create_params_default": (CreateParams, []),
    "dsv4_tensor_default": (Tensor, []),
    "dsv4_batch_default": (Batch, []),
    "dsv4_create": (_status, [POINTER(CreateParams), POINTER(c_void_p)]),
    "dsv4_destroy": (None, [_engine_p]),
    "dsv4_load": (_status, [_engine_p, c_char_p, c_int32]),
    "dsv4_load_tensor": (_status, [_engine_p, POINTER(Tensor)]),
    "dsv4_finalize": (_status, [_engine_p, c_void_p]),
    "dsv4_forward": (_status, [_engine_p, POINTER(Batch), c_void_p]),
    "dsv4_refit": (_status, [_engine_p, POINTER(Tensor), c_size_t, c_void_p]),
    # ABI minor 4.
    "dsv4_load_tensors": (_status, [_engine_p, POINTER(Tensor), c_size_t, c_void_p]),
    "dsv4_refit_begin": (_status, [_engine_p]),
    "dsv4_refit_end": (_status, [_engine_p, c_void_p]),
    "dsv4_refit_abort": (_status, [_engine_p, c_void_p]),
    "dsv4_slot_length": (_status, [_engine_p, c_int32, c_void_p, POINTER(c_int32)]),
    "dsv4_plan_memory": (_status, [POINTER(CreateParams), POINTER(MemoryPlan)]),
    "dsv4_release_slot": (_status, [_engine_p, c_int32]),
    "dsv4_get_info": (_status, [_engine_p, POINTER(Info)]),
    # ABI minor 2 (bound only when the library has it).
    "dsv4_device_error?": (_status, [_engine_p, c_void_p, POINTER(BatchFault)]),
    "dsv4_weight_count": (_status, [_engine_p, POINTER(c_size_t)]),
    "dsv4_weight_info": (_status, [_engine_p, c_size_t, POINTER(WeightDesc)]),
    "dsv4_set_log_callback": (_status, [LOG_CALLBACK, c_void_p, c_int32]),
}

_LIB = None
_LIB_LOCK = threading.Lock()


PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARY_NAME = "libdsv4.so"


class LibraryPath(NamedTuple):
    """Where the shared library is and how it was found, as returned by ``dsv4.library_path()``.

    ``path`` is the file's absolute path; ``how`` is ``"DSV4_LIBRARY"`` (the environment
    variable), ``"package"`` (``libdsv4.so`` inside the ``dsv4`` package directory),
    ``"CARGO_TARGET_DIR"`` (``$CARGO_TARGET_DIR/{release,debug}``) or ``"checkout"``
    (``target/{release,debug}`` of the dsv4 checkout above the package). Unpacks as
    ``path, how = ...``; ``os.fspath()`` (so ``Path(...)``, ``open(...)``) gives the path.
    """

    path: str
    how: str

    def __fspath__(self) -> str:
        return self.path


def find_checkout(start: Path) -> Path | None:
    """The nearest directory at or above ``start`` that is a dsv4 checkout (has Cargo.toml and
    include/dsv4.h), or None."""
    for d in (start, *start.parents):
        if (d / "Cargo.toml").is_file() and (d / "include" / "dsv4.h").is_file():
            return d
    return None


def candidates(env: Mapping[str, str] | None = None, here: Path | None = None) -> list[tuple[Path, str]]:
    """Every place the library is looked for, in order, as ``(path, how)`` (see LibraryPath).
    ``env`` defaults to ``os.environ`` and ``here`` to this package's directory."""
    env = os.environ if env is None else env
    here = PACKAGE_DIR if here is None else here
    out = []
    if env.get("DSV4_LIBRARY"):
        out.append((Path(env["DSV4_LIBRARY"]), "DSV4_LIBRARY"))
    out.append((here / LIBRARY_NAME, "package"))
    if env.get("CARGO_TARGET_DIR"):
        for profile in ("release", "debug"):
            out.append((Path(env["CARGO_TARGET_DIR"]) / profile / LIBRARY_NAME, "CARGO_TARGET_DIR"))
    checkout = find_checkout(here)
    if checkout is not None:
        for profile in ("release", "debug"):
            out.append((checkout / "target" / profile / LIBRARY_NAME, "checkout"))
    return out


def find(env: Mapping[str, str] | None = None, here: Path | None = None) -> LibraryPath:
    """The library :func:`lib` loads (the first of :func:`candidates` that is a file), without
    loading it. Raises IoError naming every place tried when there is none, or when
    ``DSV4_LIBRARY`` is set but is not a file."""
    env = os.environ if env is None else env
    here = PACKAGE_DIR if here is None else here
    explicit = env.get("DSV4_LIBRARY")
    if explicit and not Path(explicit).is_file():
        raise error_for(5, f"DSV4_LIBRARY={explicit!r} is not a file")
    cands = candidates(env, here)
    for path, how in cands:
        if path.is_file():
            return LibraryPath(os.path.abspath(path), how)
    lines = [f"{LIBRARY_NAME} not found; tried:"]
    lines += [f"  {path} ({how})" for path, how in cands]
    unset = [k for k in ("DSV4_LIBRARY", "CARGO_TARGET_DIR") if not env.get(k)]
    if unset:
        lines.append(f"  (not set: {', '.join(unset)})")
    if find_checkout(here) is None:
        lines.append(f"  (no dsv4 checkout at or above {here})")
    lines.append(
        "Set DSV4_LIBRARY to the library's path, copy it into the package directory, or build it "
        "in the checkout (cargo build --release)."
    )
    raise error_for(5, "\n".join(lines))


def lib() -> ctypes.CDLL:
    """The loaded library (loaded and checked on first call)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    with _LIB_LOCK:
        if _LIB is None:
            _LIB = _load()
    return _LIB


def _load() -> ctypes.CDLL:
    location = find()
    path = location.path
    handle = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        if name.endswith("?"):  # added in a later minor: optional
            name = name[:-1]
            if not hasattr(handle, name):
                continue
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes
    version = handle.dsv4_abi_version()
    major, minor = version >> 16, version & 0xFFFF
    if major != ABI_MAJOR or minor < ABI_MINOR:
        raise Error(
            11,
            f"{path}: ABI {major}.{minor} is incompatible with this binding (needs {ABI_MAJOR}.>={ABI_MINOR})",
        )
    # The ctypes layouts must match the library's (struct_size of the defaults).
    for fn, struct in (
        (handle.dsv4_create_params_default, CreateParams),
        (handle.dsv4_tensor_default, Tensor),
        (handle.dsv4_batch_default, Batch),
    ):
        size = fn().struct_size
        if size != ctypes.sizeof(struct):
            raise Error(12, f"{path}: {struct.__name__} is {size} bytes in the library, {ctypes.sizeof(struct)} here")
    handle.dsv4_location = location
    return handle


def abi_minor() -> int:
    """ABI minor version of the loaded library (gates features added after minor 0)."""
    return lib().dsv4_abi_version() & 0xFFFF


def last_error() -> str:
    msg = lib().dsv4_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status: int) -> None:
    """Raises the exception for a failed status, with the thread's last-error text."""
    if status != STATUS_OK:
        raise error_for(status, last_error())

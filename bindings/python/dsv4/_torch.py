"""torch interop: tensors and streams -> the raw pointers, dtype codes and CUstreams of the C ABI.

torch stays optional: this module never imports it at import time. A torch tensor can only
exist if the caller imported torch already, so :func:`is_tensor` looks torch up in
``sys.modules`` instead of importing it; torch functions (the current stream, ``torch.empty``)
are called only after a tensor was seen. Nothing here synchronizes a device, and the only
allocation is forward's logits when the caller gives none (inside ``torch.cuda.graph`` torch
serves it from the graph's pool). CUDA tensors are used as they are: no hidden device copies
or conversions, because those would run on a stream the library does not order against.
"""

from __future__ import annotations

import numbers
import sys

from . import _lib
from ._errors import invalid


def is_tensor(x) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch():
    import torch  # already imported by the caller: we only get here after seeing a tensor

    return torch


def _native_codes(torch) -> dict:
    """torch dtype -> DSV4_DTYPE_* for dtypes whose elements are exactly the stored format."""
    codes = {
        torch.float32: _lib.DTYPE_F32,
        torch.bfloat16: _lib.DTYPE_BF16,
        torch.float16: _lib.DTYPE_F16,
        torch.int32: _lib.DTYPE_I32,
        torch.int64: _lib.DTYPE_I64,
    }
    for name, code in (("float8_e4m3fn", _lib.DTYPE_F8_E4M3), ("float8_e8m0fnu", _lib.DTYPE_E8M0)):
        dt = getattr(torch, name, None)  # absent in older torch
        if dt is not None:
            codes[dt] = code
    return codes


def _fp4x2(torch):
    """torch's packed FP4 dtype (two e2m1 codes per byte, even element in the low nibble), if any."""
    return getattr(torch, "float4_e2m1fn_x2", None)


# Plain conversion targets for `dtype=` (CPU tensors only; CUDA tensors must already match).
_CONVERT = {"f32": "float32", "float32": "float32", "f16": "float16", "float16": "float16",
            "half": "float16", "i32": "int32", "int32": "int32", "i64": "int64", "int64": "int64"}


def weight_source(name: str, t, dtype, engine_device: int):
    """One weight entry from a tensor: ``(code, logical shape, data pointer, memory, kept)``.

    CPU tensors become DSV4_MEMORY_HOST (made contiguous / converted as needed: a host
    copy); CUDA tensors DSV4_MEMORY_DEVICE, which must already be contiguous, on the
    engine's device and of the stored dtype (an InvalidArgumentError otherwise). ``dtype``:
    None (from the tensor's dtype), "bf16", "fp8_e4m3" / "e8m0" / "fp4_e2m1" (raw codes in a
    uint8/int8 tensor; FP4 packed [..., cols/2] is passed with the logical shape
    [..., cols]), or a plain type ("float32", torch.int32, ...) to convert CPU tensors to.
    """
    torch = _torch()
    t = t.detach()  # pointers only; never record autograd history for copies made here
    if t.layout != torch.strided:
        raise invalid(f"weight `{name}`: {t.layout} tensors are not supported (use a dense tensor)")
    kind = t.device.type
    if kind == "cuda":
        if engine_device >= 0 and t.device.index != engine_device:
            raise invalid(f"weight `{name}` is on {t.device}, the engine on cuda:{engine_device}")
        if not t.is_contiguous():
            raise invalid(f"weight `{name}`: CUDA tensor is not contiguous (call .contiguous() on the "
                          f"stream that produced it; the binding makes no hidden device copies)")
        memory = _lib.MEMORY_DEVICE
    elif kind == "cpu":
        memory = _lib.MEMORY_HOST
    else:
        raise invalid(f"weight `{name}` is on {t.device}: only CPU and CUDA tensors are supported")
    code, t = _stored(name, t, dtype, torch, host=memory == _lib.MEMORY_HOST)
    if memory == _lib.MEMORY_HOST:
        t = t.contiguous()  # no-op when already contiguous
    if t.dim() > _lib.MAX_DIMS:
        raise invalid(f"weight `{name}`: {t.dim()} dimensions (at most {_lib.MAX_DIMS})")
    shape = tuple(int(d) for d in t.shape)
    if code == _lib.DTYPE_FP4_E2M1:
        if not shape:
            raise invalid(f"weight `{name}`: packed FP4 needs at least one dimension")
        shape = shape[:-1] + (2 * shape[-1],)  # the ABI takes the logical shape
    ptr = t.data_ptr() if t.numel() else None
    return code, shape, ptr, memory, t


def _stored(name: str, t, dtype, torch, host: bool):
    """(DSV4_DTYPE_* code, tensor holding exactly those elements) for a tensor and `dtype=`."""
    native = _native_codes(torch)
    fp4 = _fp4x2(torch)

    def convert(target):
        if t.dtype == target:
            return t
        if not host:
            raise invalid(f"weight `{name}`: CUDA tensor has dtype {t.dtype}, expected {target} "
                          f"(convert it on the device first; the binding makes no hidden device copies)")
        return t.to(target)

    if dtype is None:
        if t.dtype in native:
            return native[t.dtype], t
        if fp4 is not None and t.dtype == fp4:
            return _lib.DTYPE_FP4_E2M1, t
        if t.dtype == torch.float64:
            return _lib.DTYPE_F32, convert(torch.float32)
        raise invalid(f"weight `{name}`: unsupported dtype {t.dtype} (float32, bfloat16, float16, int32, "
                      f"int64, float8_e4m3fn, float8_e8m0fnu; raw uint8 codes need dtype='fp8_e4m3', "
                      f"'e8m0' or 'fp4_e2m1')")
    if isinstance(dtype, torch.dtype):
        key = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        key = dtype.strip().lower()
    else:
        raise invalid(f"weight `{name}`: dtype must be a str or a torch.dtype, got {dtype!r}")
    code = _lib.STORED_DTYPES.get(key)
    codes_bytes = (torch.uint8, torch.int8)
    if code == _lib.DTYPE_BF16:
        if t.dtype == torch.bfloat16:
            return code, t
        if t.dtype == torch.int16 or t.dtype == getattr(torch, "uint16", None):
            return code, t.view(torch.bfloat16)  # bit patterns; same pointer
        if t.dtype.is_floating_point:
            return code, convert(torch.bfloat16)  # round to nearest even (host only)
        raise invalid(f"weight `{name}`: cannot use dtype {t.dtype} as bf16")
    if code == _lib.DTYPE_F8_E4M3:
        if t.dtype in codes_bytes or t.dtype == getattr(torch, "float8_e4m3fn", None):
            return code, t
        raise invalid(f"weight `{name}`: dtype='fp8_e4m3' needs float8_e4m3fn or uint8/int8 codes, got "
                      f"{t.dtype} (the binding does not quantize; use weight_format='quantize' for that)")
    if code == _lib.DTYPE_E8M0:
        if t.dtype in codes_bytes or t.dtype == getattr(torch, "float8_e8m0fnu", None):
            return code, t
        raise invalid(f"weight `{name}`: dtype='e8m0' needs float8_e8m0fnu or uint8 bytes, got {t.dtype}")
    if code == _lib.DTYPE_FP4_E2M1:
        if t.dtype in codes_bytes or (fp4 is not None and t.dtype == fp4):
            return code, t
        raise invalid(f"weight `{name}`: dtype='fp4_e2m1' needs packed uint8/int8 codes [..., cols/2], got {t.dtype}")
    target = _CONVERT.get(key)
    if target is None:
        raise invalid(f"weight `{name}`: unknown dtype {dtype!r}")
    t = convert(getattr(torch, target))
    return native[t.dtype], t


def device_int32(x, what: str, device: int):
    """A batch array for a CUDA engine: a contiguous 1-D int32 torch tensor on cuda:`device`."""
    want = f"a contiguous 1-D int32 torch tensor on cuda:{device}"
    if not is_tensor(x):
        raise invalid(f"{what} must be {want} (a CUDA engine reads batch arrays from device memory), "
                      f"got {type(x).__name__}")
    torch = _torch()
    if x.device.type != "cuda" or x.device.index != device:
        raise invalid(f"{what} is on {x.device}, must be {want}")
    if x.dtype != torch.int32:
        raise invalid(f"{what} has dtype {x.dtype}, must be {want}")
    if x.dim() != 1:
        raise invalid(f"{what} has shape {tuple(x.shape)}, must be {want}")
    if not x.is_contiguous():
        raise invalid(f"{what} is not contiguous, must be {want}")
    return x


def host_numpy(x, what: str):
    """A CPU tensor's values as numpy, for a CPU engine's batch arrays."""
    if x.device.type != "cpu":
        raise invalid(f"{what} is on {x.device}, but the engine runs on the CPU (pass CPU tensors or numpy)")
    if x.is_floating_point() or x.is_complex():
        raise invalid(f"{what} must hold integers, got dtype {x.dtype}")
    return x.detach().numpy()


def logits_code(out, rows: int, vocab: int, device: int) -> int:
    """DSV4_LOGITS_* for a caller-provided logits tensor, after checking it can take the output."""
    torch = _torch()
    where = "cpu" if device == _lib.DEVICE_CPU else f"cuda:{device}"
    if device == _lib.DEVICE_CPU:
        ok = out.device.type == "cpu"
    else:
        ok = out.device.type == "cuda" and out.device.index == device
    if not ok:
        raise invalid(f"logits is on {out.device}, must be on the engine's device {where}")
    if out.dtype == torch.float32:
        code = _lib.LOGITS_F32
    elif out.dtype == torch.bfloat16:
        code = _lib.LOGITS_BF16
    else:
        raise invalid(f"logits has dtype {out.dtype}, must be float32 or bfloat16")
    if tuple(out.shape) != (rows, vocab):
        raise invalid(f"logits has shape {tuple(out.shape)}, must be [num_logits, vocab_size] = [{rows}, {vocab}]")
    if not out.is_contiguous():
        raise invalid("logits is not contiguous")
    return code


def empty_logits(rows: int, vocab: int, like):
    """A float32 [rows, vocab] output on `like`'s device (graph pool memory while capturing)."""
    torch = _torch()
    return torch.empty((rows, vocab), dtype=torch.float32, device=like.device)


def from_numpy(a):
    return _torch().from_numpy(a)


def current_stream(device: int) -> int | None:
    """torch's current stream on cuda:`device` as a raw CUstream (None = the legacy stream)."""
    return _torch().cuda.current_stream(device).cuda_stream or None


def synchronize_current(device: int) -> None:
    _torch().cuda.current_stream(device).synchronize()


def stream_handle(stream, device: int) -> int | None:
    """A ``stream=`` argument as a raw CUstream: None (the legacy default stream), an int
    (a CUstream address), a torch.cuda.Stream / ExternalStream (``.cuda_stream``), or any
    object with the ``__cuda_stream__`` protocol. A torch stream of another device than the
    engine's is refused."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise invalid(f"stream must be None, an int (CUstream) or a torch.cuda.Stream, got {stream!r}")
    if isinstance(stream, numbers.Integral):
        if int(stream) < 0:
            raise invalid(f"stream must be a CUstream address (>= 0), got {stream}")
        return int(stream) or None
    handle = getattr(stream, "cuda_stream", None)
    if handle is None and callable(getattr(stream, "__cuda_stream__", None)):
        _version, handle = stream.__cuda_stream__()
    if not isinstance(handle, numbers.Integral) or isinstance(handle, bool):
        raise invalid(f"stream must be None, an int (CUstream) or a torch.cuda.Stream, got {type(stream).__name__}")
    dev = getattr(stream, "device", None)
    if (device >= 0 and getattr(dev, "type", None) == "cuda" and dev.index is not None
            and dev.index != device):
        raise invalid(f"stream belongs to {dev}, the engine to cuda:{device}")
    return int(handle) or None

"""Shared by the torch tests: fixture paths, a dependency-free safetensors reader that keeps
every tensor's raw bytes (so FP8 / E8M0 / packed-FP4 tensors come back bit-exact whatever the
installed safetensors version supports), and the oracle prompts. Importable without torch
and without pytest (test_torch_cuda.py also runs as a plain script)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"

# safetensors dtype -> (numpy dtype of the raw elements, torch dtype name)
_DTYPES = {
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),  # numpy: bit patterns
    "I64": (np.int64, "int64"),
    "I32": (np.int32, "int32"),
    "I8": (np.int8, "int8"),
    "U8": (np.uint8, "uint8"),
    "F8_E4M3": (np.uint8, "float8_e4m3fn"),
    "F8_E8M0": (np.uint8, "float8_e8m0fnu"),
}

# The dsv4 `dtype=` string a checkpoint tensor needs when its element type alone does not say
# what it holds. tiny_fp8 stores packed FP4 expert weights as I8 (README: two e2m1 codes per
# byte, low nibble = even column).
ENTRY_DTYPE = {"I8": "fp4_e2m1", "BF16": "bf16", "F8_E4M3": "fp8_e4m3", "F8_E8M0": "e8m0"}


def _read_file(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), raw[8 + n + a : 8 + n + b])
    return out


def read_raw(model: str, file: str | None = None) -> dict:
    """{name: (safetensors dtype, shape, bytes)} of a fixture's checkpoint (sharded or not),
    or of one named file in its directory."""
    d = FIXTURES / model
    if file is not None:
        return _read_file(d / file)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        out = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(_read_file(d / shard))
        return out
    return _read_file(d / "model.safetensors")


def to_numpy(dtype: str, shape, buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=_DTYPES[dtype][0]).reshape(shape).copy()


def to_torch(dtype: str, shape, buf: bytes):
    import torch

    u8 = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return u8.view(getattr(torch, _DTYPES[dtype][1])).reshape(shape)


def prompts(model: str) -> list[np.ndarray]:
    o = read_raw(model, "oracle.safetensors")
    out, s = [], 0
    while f"prompt.{s}" in o:
        out.append(to_numpy(*o[f"prompt.{s}"]).astype(np.int32))
        s += 1
    return out


def has(model: str) -> bool:
    d = FIXTURES / model
    return (d / "config.json").is_file() and (
        (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file())

"""Python binding vs the transformers fp32 oracle (tests/fixtures): one-shot and chunked
prefill with interleaved sequences, then batched decode. Tolerance: max |dlogit| <= 1e-3."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import dsv4

FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"
TOL = 1e-3


def read_safetensors(path):
    """Minimal safetensors reader (numpy only): {name: array}."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.float32, "I32": np.int32, "I64": np.int64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[8 + n + a : 8 + n + b]
        out[name] = np.frombuffer(buf, dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def oracle(model):
    o = read_safetensors(FIXTURES / model / "oracle.safetensors")
    prompts, logits = [], []
    s = 0
    while f"prompt.{s}" in o:
        prompts.append(o[f"prompt.{s}"].astype(np.int32))
        logits.append(o[f"logits.{s}"])
        s += 1
    return prompts, logits


def run_schedule(engine, prompts, schedule):
    """schedule: list of steps, each a list of (seq, length); returns per-sequence logits."""
    got = [None] * len(prompts)
    parts = [[] for _ in prompts]
    nxt = [0] * len(prompts)
    for step in schedule:
        toks, pos, slots, qs = [], [], [], [0]
        for seq, n in step:
            toks.extend(prompts[seq][nxt[seq] : nxt[seq] + n])
            pos.extend(range(nxt[seq], nxt[seq] + n))
            slots.append(seq)
            qs.append(len(toks))
        out = engine.forward(
            np.array(toks, np.int32), np.array(pos, np.int32), np.array(slots, np.int32), np.array(qs, np.int32)
        )
        row = 0
        for seq, n in step:
            parts[seq].append(out[row : row + n])
            row += n
            nxt[seq] += n
    for s in range(len(prompts)):
        got[s] = np.concatenate(parts[s])
    return got


@pytest.mark.parametrize("model", ["tiny", "tiny_native"])
def test_parity_one_shot_chunked_decode(model):
    prompts, want = oracle(model)
    d = str(FIXTURES / model)
    with dsv4.Engine(d, device="cpu", max_num_seqs=4, max_num_tokens=128, max_seq_len=64, numerics="exact") as e:
        # One-shot: all sequences in one batch.
        got = run_schedule(e, prompts, [[(s, len(p)) for s, p in enumerate(prompts)]])
        worst = max(np.abs(g - w).max() for g, w in zip(got, want))
        assert worst <= TOL, worst
        # Chunked with odd sizes, sequences at different offsets, then single-token decode.
        left = [len(p) for p in prompts]
        sizes = [5, 3, 7, 1]
        schedule, k = [], 0
        while any(n > 8 for n in left):
            step = []
            for s in range(len(prompts)):
                n = min(sizes[(k + s) % 4], left[s] - 8 if left[s] > 8 else 0)
                if n > 0:
                    step.append((s, n))
                    left[s] -= n
            schedule.append(step)
            k += 1
        while any(left):
            step = [(s, 1) for s in range(len(prompts)) if left[s]]
            for s, _ in step:
                left[s] -= 1
            schedule.append(step)
        got = run_schedule(e, prompts, schedule)
        worst = max(np.abs(g - w).max() for g, w in zip(got, want))
        print(f"{model}: chunked + decode max |dlogit| = {worst:.3e}")
        assert worst <= TOL, worst


def test_chunked_refit_from_dummy_equals_load():
    """RL flow: dummy engine, then sync the checkpoint's weights in two chunks."""
    prompts, want = oracle("tiny")
    d = str(FIXTURES / "tiny")
    raw = read_safetensors_raw(FIXTURES / "tiny" / "model.safetensors")
    with dsv4.Engine(d, device="cpu", load="dummy", max_num_seqs=1, max_num_tokens=64, max_seq_len=64,
                     numerics="exact") as e:
        names = sorted(raw)
        with e.refitting():
            with pytest.raises(dsv4.Error) as err:
                e.forward(np.array([1], np.int32), np.array([0], np.int32), np.array([0], np.int32),
                          np.array([0, 1], np.int32))
            assert err.value.status == 3  # STATE
            for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
                e.refit_many({n: raw[n][0] for n in chunk if raw[n][1] != "BF16"})
                e.refit_many({n: raw[n][0] for n in chunk if raw[n][1] == "BF16"}, dtype="bf16")
        p = prompts[0]
        got = e.forward(p, np.arange(len(p), dtype=np.int32), np.array([0], np.int32),
                        np.array([0, len(p)], np.int32))
        assert np.abs(got - want[0]).max() <= TOL


def read_safetensors_raw(path):
    """{name: (array, dtype)} with BF16 kept as uint16 bit patterns."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.float32, "I64": np.int64, "BF16": np.uint16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
        out[name] = (arr, info["dtype"])
    return out

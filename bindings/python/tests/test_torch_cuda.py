"""torch + CUDA engine: forward from torch CUDA tensors, torch.cuda.graph capture and replay,
refit (host and device tensors) after capture. Every compared logit buffer is filled with NaN
before the forward or replay that should write it, and every comparison is bit for bit (the
CUDA backend is bit-identical to the CPU reference; see README.md).

Without torch+CUDA, or when the library cannot create a device-0 engine, the module is skipped
with the reason `skipped: no CUDA device` (also printed). Runs under pytest or as a plain script
(no pytest needed), which prints one PASS/FAIL/SKIP line per case and exits nonzero on failure:

    DSV4_LIBRARY=/path/libdsv4.so python -m pytest -q -s bindings/python/tests/test_torch_cuda.py
    DSV4_LIBRARY=/path/libdsv4.so python bindings/python/tests/test_torch_cuda.py
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
for p in (HERE.parent, HERE):  # the dsv4 package and _fixtures (conftest.py does the first under pytest)
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

try:
    import pytest
except ImportError:  # plain-script mode on a machine without pytest
    pytest = None

import dsv4  # noqa: E402
from dsv4 import _lib  # noqa: E402

import _fixtures as fx  # noqa: E402

SKIP_NO_CUDA = "skipped: no CUDA device"
SCRIPT = __name__ == "__main__"
CAPS = dict(max_num_seqs=4, max_num_tokens=128, max_seq_len=64, num_threads=2, numerics="exact")
NAN = float("nan")


def _probe() -> str | None:
    """None when the CUDA cases can run, else why not."""
    try:
        import torch
    except ImportError:
        return "skipped: torch is not installed"
    if not torch.cuda.is_available():
        return SKIP_NO_CUDA
    try:
        # dsv4_create only: a failure later (kernel compilation at finalize, e.g. NVRTC not on
        # LD_LIBRARY_PATH) must fail the cases loudly, not skip them.
        with dsv4.Engine(load=None, device=0, max_num_seqs=1, max_num_tokens=8, max_seq_len=16):
            pass
    except (dsv4.NoDeviceError, dsv4.CudaError, dsv4.UnsupportedError) as err:
        print(f"dsv4 cannot create a device-0 engine: {err}")
        return SKIP_NO_CUDA
    return None


REASON = _probe()
if REASON is not None:
    print(REASON)
    if pytest is not None and not SCRIPT:
        pytest.skip(REASON, allow_module_level=True)
else:
    import torch


class Skip(Exception):
    pass


def skip(reason: str):
    print(reason)
    if pytest is not None and not SCRIPT:
        pytest.skip(reason)
    raise Skip(reason)


# -- helpers ---------------------------------------------------------------------------------


def cuda_engine(model="tiny", **kw):
    return dsv4.Engine(str(fx.FIXTURES / model), device=0, **{**CAPS, **kw})


def cpu_engine(model="tiny", **kw):
    return dsv4.Engine(str(fx.FIXTURES / model), device="cpu", **{**CAPS, **kw})


def dev(values):
    """A contiguous int32 tensor on cuda:0 (None stays None)."""
    if values is None:
        return None
    return torch.as_tensor(np.asarray(values, dtype=np.int32)).to("cuda:0")


def poisoned(rows, vocab, dtype=None, device="cuda:0"):
    return torch.full((rows, vocab), NAN, dtype=dtype or torch.float32, device=device)


def check_same(got, want, what):
    """`got` and `want` (tensors on any device, or numpy) are finite and equal bit for bit."""
    g = got.detach().cpu() if torch.is_tensor(got) else torch.from_numpy(np.asarray(got))
    w = want.detach().cpu() if torch.is_tensor(want) else torch.from_numpy(np.asarray(want))
    assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
    assert torch.isfinite(g.float()).all(), f"{what}: result has non-finite values (NaN poison not overwritten?)"
    assert torch.isfinite(w.float()).all(), f"{what}: reference has non-finite values"
    ibits = torch.int16 if g.dtype == torch.bfloat16 else torch.int32
    gi, wi = g.view(ibits), w.view(ibits)
    if not torch.equal(gi, wi):
        n = int((gi != wi).sum())
        d = float((g.float() - w.float()).abs().max())
        raise AssertionError(f"{what}: {n} of {g.numel()} values differ bitwise, max |d| = {d:.3e}")


def steps_for(prompts, decode=5):
    """Prefill of two sequences (13 and 9 tokens in slots 0 and 1; logits of rows 12, 21, 0),
    then `decode` batched one-token steps (teacher forcing). [(tok, pos, slots, qs, rows)]"""
    p0, p1 = prompts[0], prompts[1]
    steps = [(np.r_[p0[:13], p1[:9]], np.r_[np.arange(13), np.arange(9)], [0, 1], [0, 13, 22], [12, 21, 0])]
    for k in range(decode):
        steps.append(([p0[13 + k], p1[9 + k]], [13 + k, 9 + k], [0, 1], [0, 1, 2], None))
    return steps


def checkpoint_entries(model, on_gpu):
    """Every checkpoint tensor as a refit entry (name, tensor, dtype); entry k is moved to
    cuda:0 when on_gpu(k) (DSV4_MEMORY_DEVICE), else stays a CPU tensor (DSV4_MEMORY_HOST)."""
    out = []
    for k, (name, (dt, shape, buf)) in enumerate(sorted(fx.read_raw(model).items())):
        t = fx.to_torch(dt, shape, buf)
        out.append((name, t.to("cuda:0") if on_gpu(k) else t, "fp4_e2m1" if dt == "I8" else None))
    return out


def pointers(e):
    """Everything that must not move: info()'s buffer ranges (ABI minor >= 1) and every
    weight's data and scale address."""
    info = e.info()
    ranges = {k: info[k] for k in _lib.INFO_FIELDS_MINOR1 if k in info}
    descs = [(d["name"], d["data"], d["nbytes"], d["scale"], d["scale_nbytes"], d["derived"]) for d in e.weight_descs()]
    return ranges, descs


def stored_formats() -> bool:
    return _lib.abi_minor() >= _lib.ABI_MINOR_STORED_FORMATS


# -- (a) eager forward with torch CUDA tensors == CPU engine ----------------------------------


def test_eager_forward_equals_cpu_engine_bitwise():
    steps = steps_for(fx.prompts("tiny"))
    side = torch.cuda.Stream()
    with cpu_engine() as cpu, cuda_engine() as gpu:
        vocab = gpu.vocab_size
        for k, (tok, pos, slots, qs, rows) in enumerate(steps):
            d = [dev(a) for a in (tok, pos, slots, qs, rows)]
            n = len(tok) if rows is None else len(rows)
            if k == 2:  # bf16 output on both backends
                want = cpu.forward(tok, pos, slots, qs, rows, logits=poisoned(n, vocab, torch.bfloat16, "cpu"))
                out = poisoned(n, vocab, torch.bfloat16)
                got = gpu.forward(*d, logits=out)
                assert got is out
            else:
                want = cpu.forward(tok, pos, slots, qs, rows)
                out = poisoned(n, vocab)
                cur = torch.cuda.current_stream()
                if k == 0:  # no logits=: the binding allocates a float32 CUDA tensor
                    got = gpu.forward(*d)
                    assert got.is_cuda and got.dtype == torch.float32 and tuple(got.shape) == (n, vocab)
                elif k == 1:  # caller-owned output, torch's current stream
                    got = gpu.forward(*d, logits=out)
                elif k == 3:  # stream= a torch.cuda.Stream
                    side.wait_stream(cur)
                    got = gpu.forward(*d, logits=out, stream=side)
                    cur.wait_stream(side)
                elif k == 4:  # stream= a raw CUstream int
                    side.wait_stream(cur)
                    got = gpu.forward(*d, logits=out, stream=side.cuda_stream)
                    cur.wait_stream(side)
                else:  # stream=None inside `with torch.cuda.stream(side)`: the current stream is side
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        got = gpu.forward(*d, logits=out)
                    cur.wait_stream(side)
                if k != 0:
                    assert got is out
            torch.cuda.synchronize()
            check_same(got, want, f"step {k}")


# -- (b) CUDA graph capture of a decode step and of a prefill chunk -------------------------------


def test_graph_decode_step_replays_like_eager():
    p0, p1 = fx.prompts("tiny")[:2]
    with cuda_engine() as eager, cuda_engine() as captured:
        vocab = eager.vocab_size
        prefill = [dev(a) for a in (np.r_[p0[:13], p1[:9]], np.r_[np.arange(13), np.arange(9)], [0, 1], [0, 13, 22])]
        for e in (eager, captured):  # identical slot state in both engines
            e.forward(*prefill, logits=poisoned(22, vocab))
        tok, pos, slots, qs = dev([p0[13], p1[9]]), dev([13, 9]), dev([0, 1]), dev([0, 1, 2])
        out = poisoned(2, vocab)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ret = captured.forward(tok, pos, slots, qs, logits=out)
        assert ret is out
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "capture executed the forward (it must only record it)"
        # Step k: new contents in the static inputs, then replay vs an eager forward of the same
        # batch. Step 2 swaps the sequences' order in the batch (slots read from device too).
        for k in range(5):
            rows = [(0, p0[13 + k], 13 + k), (1, p1[9 + k], 9 + k)]
            if k == 2:
                rows.reverse()
            tok.copy_(torch.tensor([r[1] for r in rows], dtype=torch.int32))
            pos.copy_(torch.tensor([r[2] for r in rows], dtype=torch.int32))
            slots.copy_(torch.tensor([r[0] for r in rows], dtype=torch.int32))
            out.fill_(NAN)
            graph.replay()
            ref = poisoned(2, vocab)
            eager.forward(dev([r[1] for r in rows]), dev([r[2] for r in rows]), dev([r[0] for r in rows]),
                          dev([0, 1, 2]), logits=ref)
            torch.cuda.synchronize()
            check_same(out, ref, f"decode replay {k}")


def test_graph_prefill_chunk_replays_like_eager():
    p = fx.prompts("tiny")
    # Two sequences of 5 and 3 tokens starting at position 0 (slots 2 and 3): the chunk resets
    # its slots itself, so every replay is self-contained. Logits for three chosen rows.
    chunks = [(np.r_[p[0][:5], p[1][:3]], [4, 7, 0]), (np.r_[p[2][:5], p[0][20:23]], [1, 5, 6])]
    positions, slot_ids, qstart = np.r_[np.arange(5), np.arange(3)], [2, 3], [0, 5, 8]
    with cuda_engine() as eager, cuda_engine() as captured:
        vocab = eager.vocab_size
        tok, pos, slots, qs, rows = dev(chunks[0][0]), dev(positions), dev(slot_ids), dev(qstart), dev(chunks[0][1])
        out = poisoned(3, vocab)
        torch.cuda.synchronize()
        g_out = torch.cuda.CUDAGraph()  # caller-provided logits
        with torch.cuda.graph(g_out):
            captured.forward(tok, pos, slots, qs, rows, logits=out)
        g_alloc = torch.cuda.CUDAGraph()  # logits allocated by the binding (from the graph's pool)
        with torch.cuda.graph(g_alloc):
            alloc = captured.forward(tok, pos, slots, qs, rows)
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "capture executed the forward (it must only record it)"
        for k, (toks, picked) in enumerate([chunks[0], chunks[1], chunks[0], chunks[1]]):
            tok.copy_(torch.as_tensor(np.asarray(toks, np.int32)))
            rows.copy_(torch.as_tensor(np.asarray(picked, np.int32)))
            if k < 3:
                out.fill_(NAN)
                g_out.replay()
                got = out
            else:
                alloc.fill_(NAN)
                g_alloc.replay()
                got = alloc
            ref = poisoned(3, vocab)
            eager.forward(dev(toks), dev(positions), dev(slot_ids), dev(qstart), dev(picked), logits=ref)
            torch.cuda.synchronize()
            check_same(got, ref, f"prefill replay {k}")
            # The replay wrote the slots' state like the eager forward: one decode step agrees.
            step = (dev([toks[4], toks[7]]), dev([5, 3]), dev(slot_ids), dev([0, 1, 2]))
            d_graph, d_eager = poisoned(2, vocab), poisoned(2, vocab)
            captured.forward(*step, logits=d_graph)
            eager.forward(*step, logits=d_eager)
            torch.cuda.synchronize()
            check_same(d_graph, d_eager, f"decode after prefill replay {k}")


# -- (c) refit after capture -----------------------------------------------------------------------


def test_refit_after_capture_replays_with_new_weights():
    """Capture a prefill on an engine holding dummy weights, refit every weight from the tiny
    checkpoint (half as CUDA tensors: DSV4_MEMORY_DEVICE, half as CPU tensors), replay the OLD
    graph: == an engine that loaded the checkpoint. Nothing moved. (With an ABI-minor-0 library,
    which has no device-memory entries, every tensor stays on the host.)"""
    gpu_half = stored_formats()
    if not gpu_half:
        print(f"note: library ABI minor {_lib.abi_minor()} < {_lib.ABI_MINOR_STORED_FORMATS}: "
              "refitting from host tensors only")
    p0, p1 = fx.prompts("tiny")[:2]
    batch = (np.r_[p0[:12], p1[:7]], np.r_[np.arange(12), np.arange(7)], [0, 1], [0, 12, 19])
    entries = checkpoint_entries("tiny", on_gpu=lambda k: gpu_half and k % 2 == 0)
    assert not gpu_half or sum(v.is_cuda for _, v, _ in entries) == (len(entries) + 1) // 2
    with cuda_engine(load="dummy") as e:
        vocab = e.vocab_size
        static = [dev(a) for a in batch]
        out = poisoned(19, vocab)
        before = pointers(e)
        if gpu_half:
            info = e.info()
            for k in ("weights_base", "state_base", "workspace_base"):
                assert info[k] != 0 and info[k.replace("_base", "_nbytes")] > 0, (k, info)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            e.forward(*static, logits=out)
        graph.replay()  # dummy weights
        torch.cuda.synchronize()
        dummy = out.clone()
        assert torch.isfinite(dummy).all()

        half = len(entries) // 2
        with e.refitting():
            e.refit_many(entries[:half])  # stream=None: torch's current stream (orders the .to("cuda") copies)
            e.refit_many(entries[half:])
        torch.cuda.synchronize()
        assert pointers(e) == before, "refit moved a buffer or a weight"

        with cuda_engine() as fresh:
            ref = poisoned(19, vocab)
            fresh.forward(*[dev(a) for a in batch], logits=ref)
            for k in range(2):  # position 0 restarts the slots: every replay is the same prefill
                out.fill_(NAN)
                graph.replay()
                torch.cuda.synchronize()
                check_same(out, ref, f"replay {k} after refit")
        assert not torch.equal(dummy, out), "the refit did not change the logits"


def test_refit_stored_formats_from_device_tensors_equals_load():
    """tiny_fp8 on CUDA: dummy engine, every tensor refit in its stored format (FP8 codes as
    float8_e4m3fn, E8M0 scales as float8_e8m0fnu, packed FP4 as int8), half from device memory
    == the engine that loaded the checkpoint; weights and scales did not move."""
    if not stored_formats():
        skip(f"library ABI minor {_lib.abi_minor()} < {_lib.ABI_MINOR_STORED_FORMATS}: no stored-format entries")
    steps = steps_for(fx.prompts("tiny_fp8"), decode=2)
    # A quantized weight and its scale may live in different memories: each entry is its own.
    entries = checkpoint_entries("tiny_fp8", on_gpu=lambda k: k % 2 == 1)
    with cuda_engine("tiny_fp8") as ref, cuda_engine("tiny_fp8", load="dummy") as e:
        before = pointers(e)
        e.refit_many(entries)
        torch.cuda.synchronize()
        assert pointers(e) == before, "refit moved a buffer or a weight"
        for k, (tok, pos, slots, qs, rows) in enumerate(steps):
            n = len(tok) if rows is None else len(rows)
            got, want = poisoned(n, e.vocab_size), poisoned(n, e.vocab_size)
            e.forward(*[dev(a) for a in (tok, pos, slots, qs, rows)], logits=got)
            ref.forward(*[dev(a) for a in (tok, pos, slots, qs, rows)], logits=want)
            torch.cuda.synchronize()
            check_same(got, want, f"tiny_fp8 step {k}")


def test_load_tensor_from_device_tensors_equals_load():
    """Streaming load (dsv4_load_tensor) of the tiny checkpoint, every other tensor from device
    memory, then finalize == the engine that loaded the directory."""
    if not stored_formats():
        skip(f"library ABI minor {_lib.abi_minor()} < {_lib.ABI_MINOR_STORED_FORMATS}: no device-memory entries")
    steps = steps_for(fx.prompts("tiny"), decode=1)
    with cuda_engine() as ref, cuda_engine(load=None) as e:
        for name, value, dtype in checkpoint_entries("tiny", on_gpu=lambda k: k % 2 == 0):
            e.load_tensor(name, value, dtype)
        assert e.info()["phase"] == "loaded"
        e.finalize()
        for k, (tok, pos, slots, qs, rows) in enumerate(steps):
            n = len(tok) if rows is None else len(rows)
            got, want = poisoned(n, e.vocab_size), poisoned(n, e.vocab_size)
            e.forward(*[dev(a) for a in (tok, pos, slots, qs, rows)], logits=got)
            ref.forward(*[dev(a) for a in (tok, pos, slots, qs, rows)], logits=want)
            torch.cuda.synchronize()
            check_same(got, want, f"streamed load step {k}")


# -- errors ------------------------------------------------------------------------------------


def test_cuda_argument_errors_name_the_argument():
    def raises(cls, text, fn):
        try:
            fn()
        except cls as err:
            assert text in err.message, f"expected {text!r} in {err.message!r}"
            return
        raise AssertionError(f"no {cls.__name__} ({text!r})")

    with cuda_engine() as e, cuda_engine() as fresh:
        vocab = e.vocab_size
        ok = [dev(v) for v in ([1, 2], [0, 1], [0], [0, 2])]
        host = [np.array(v, np.int32) for v in ([1, 2], [0, 1], [0], [0, 2])]
        raises(dsv4.UnsupportedError, "needs a CPU engine", lambda: e.forward(*host))
        raises(dsv4.InvalidArgumentError, "token_ids must be", lambda: e.forward(host[0], *ok[1:]))
        raises(dsv4.InvalidArgumentError, "token_ids is on cpu", lambda: e.forward(ok[0].cpu(), *ok[1:]))
        raises(dsv4.InvalidArgumentError, "positions has dtype torch.int64",
               lambda: e.forward(ok[0], ok[1].long(), *ok[2:]))
        raises(dsv4.InvalidArgumentError, "token_ids is not contiguous",
               lambda: e.forward(dev([1, 9, 2, 9])[::2], *ok[1:]))
        raises(dsv4.InvalidArgumentError, "query_start has shape", lambda: e.forward(*ok[:3], ok[3].reshape(1, 2)))
        raises(dsv4.InvalidArgumentError, "logits_rows must be", lambda: e.forward(*ok, [0]))
        raises(dsv4.InvalidArgumentError, "logits is on cpu",
               lambda: e.forward(*ok, logits=poisoned(2, vocab, device="cpu")))
        raises(dsv4.InvalidArgumentError, "logits has dtype torch.float16",
               lambda: e.forward(*ok, logits=poisoned(2, vocab, torch.float16)))
        raises(dsv4.InvalidArgumentError, "logits has shape", lambda: e.forward(*ok, logits=poisoned(3, vocab)))
        raises(dsv4.InvalidArgumentError, "stream", lambda: e.forward(*ok, stream="default"))
        name = "layers.0.attn_norm.weight"
        shape = dict((n, s) for n, _, s, _ in e.weights())[name]
        w = torch.ones(shape, device="cuda:0")
        raises(dsv4.InvalidArgumentError, "not contiguous",
               lambda: e.refit(name, torch.ones(2 * shape[0], device="cuda:0")[::2]))
        raises(dsv4.InvalidArgumentError, "convert it on the device first", lambda: e.refit(name, w, dtype="bf16"))
        if torch.cuda.device_count() > 1:
            raises(dsv4.InvalidArgumentError, "is on cuda:1", lambda: e.refit(name, w.to("cuda:1")))
            raises(dsv4.InvalidArgumentError, "stream belongs to cuda:1",
                   lambda: e.forward(*ok, stream=torch.cuda.Stream(device=1)))
        # None of that changed the engine.
        got, want = poisoned(2, vocab), poisoned(2, vocab)
        e.forward(*ok, logits=got)
        fresh.forward(*ok, logits=want)
        torch.cuda.synchronize()
        check_same(got, want, "after errors")


# -- (f) bad device batches and padding -------------------------------------------------------


def test_bad_device_batch_is_recorded_and_changes_nothing():
    """A bad batch from CUDA tensors: forward returns (it cannot see device values), the logits
    are NaN, device_error() names the field and index as the CPU engine's error does, the
    record clears, and the engine then equals a twin that never saw the bad batch."""
    if _lib.abi_minor() < _lib.ABI_MINOR_DEVICE_ERROR:
        skip("the library predates the device error record")
    with cuda_engine() as e, cuda_engine() as twin, cpu_engine() as cpu:
        vocab = e.vocab_size
        ok = ([1, 2, 3], [0, 1, 2], [0], [0, 3])
        for eng in (e, twin):
            eng.forward(*[dev(a) for a in ok], logits=poisoned(3, vocab))
        cpu.forward(*ok)
        bad = ([4, -5], [3, 4], [0], [0, 2])
        try:
            cpu.forward(*bad)
            raise AssertionError("the CPU engine accepted a bad batch")
        except dsv4.InvalidArgumentError as err:
            cpu_message = err.message
        out = poisoned(2, vocab)
        out.fill_(1.0)
        e.forward(*[dev(a) for a in bad], logits=out)
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), "a bad batch's logits must be NaN"
        f = e.device_error(stream=torch.cuda.current_stream())
        assert f is not None and (f.field, f.index, f.value, f.rule) == ("token_ids", 1, -5, "range")
        assert f.status == "INVALID_ARGUMENT" and f.message == cpu_message.split(": ", 1)[-1]
        assert e.device_error() is None, "reading clears the record"
        assert e.info()["device_error"] != 0
        # Padding next to a real continuation, then both engines agree.
        got, want = poisoned(3, vocab), poisoned(1, vocab)
        e.forward(dev([7, 8, 9]), dev([-1, 99, 3]), dev([dsv4.PAD_SLOT, 0]), dev([0, 2, 3]), logits=got)
        twin.forward(dev([9]), dev([3]), dev([0]), dev([0, 1]), logits=want)
        torch.cuda.synchronize()
        assert (got[:2] == 0).all()
        check_same(got[2:], want, "real row beside padding")
        assert e.device_error() is None


# -- plain-script runner -------------------------------------------------------------------------


def main() -> int:
    if REASON is not None:
        return 0  # already printed
    print(f"dsv4 {dsv4.version()} at {dsv4.library_path()}; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    cases = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    failed = 0
    for name, fn in cases:
        try:
            fn()
            print(f"PASS {name}")
        except Skip as s:
            print(f"SKIP {name}: {s}")
        except Exception:
            traceback.print_exc()
            print(f"FAIL {name}")
            failed += 1
        sys.stdout.flush()
    print(f"{len(cases) - failed} of {len(cases)} cases did not fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

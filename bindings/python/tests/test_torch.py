"""torch interop of the binding on the CPU backend: torch CPU tensors in forward, refit and
load_tensor give bit-identical results to the numpy paths; stored-format (FP8 / E8M0 / FP4)
entries from the tiny_fp8 checkpoint (ABI minor >= 1). Skipped when torch is not importable.

    DSV4_LIBRARY=target/release/libdsv4.so python -m pytest bindings/python/tests/test_torch.py
"""

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsv4  # noqa: E402
from dsv4 import _lib  # noqa: E402
from dsv4.engine import _tensor_entry  # noqa: E402

import _fixtures as fx  # noqa: E402

CAPS = dict(max_num_seqs=4, max_num_tokens=128, max_seq_len=64, num_threads=2, numerics="exact")
STORED = pytest.mark.skipif(
    _lib.abi_minor() < _lib.ABI_MINOR_STORED_FORMATS,
    reason=f"library ABI minor {_lib.abi_minor()} < {_lib.ABI_MINOR_STORED_FORMATS}: no FP8/FP4/E8M0 "
           f"entries, info buffer ranges or derived listing",
)
needs = {m: pytest.mark.skipif(not fx.has(m), reason=f"no {m} fixture") for m in ("tiny", "tiny_fp8")}


def bits(a):
    """Bit patterns of a float32/bfloat16 numpy array or torch tensor (NaN-safe, -0.0-exact)."""
    if torch.is_tensor(a):
        a = a.detach().cpu()
        return a.view(torch.int16).numpy() if a.dtype == torch.bfloat16 else a.numpy().view(np.uint32)
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def assert_same_bits(got, want, what=""):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    if not np.array_equal(g, w):
        gf = got.float().numpy() if torch.is_tensor(got) else got
        wf = want.float().numpy() if torch.is_tensor(want) else want
        raise AssertionError(f"{what}: {np.count_nonzero(g != w)} of {g.size} values differ, "
                             f"max |d| = {np.nanmax(np.abs(gf - wf))}")


def steps_for(prompts, decode=4):
    """Prefill of two sequences (13 and 9 tokens, slots 0 and 1, logits of 3 rows), then
    `decode` batched single-token steps: [(token_ids, positions, seq_slots, query_start, rows)]."""
    p0, p1 = prompts[0], prompts[1]
    steps = [(np.concatenate([p0[:13], p1[:9]]), np.r_[np.arange(13), np.arange(9)].astype(np.int32),
              np.array([0, 1], np.int32), np.array([0, 13, 22], np.int32), np.array([12, 21, 0], np.int32))]
    for k in range(decode):
        steps.append((np.array([p0[13 + k], p1[9 + k]], np.int32), np.array([13 + k, 9 + k], np.int32),
                      np.array([0, 1], np.int32), np.array([0, 1, 2], np.int32), None))
    return steps


def run_numpy(e, steps):
    return [e.forward(*s) for s in steps]


def tiny_engine(model="tiny", **kw):
    return dsv4.Engine(str(fx.FIXTURES / model), device="cpu", **{**CAPS, **kw})


def checkpoint_entries(model, as_torch=True):
    """Every checkpoint tensor as a refit entry `(name, value, dtype)`: torch tensors with
    their native dtypes (FP8 codes float8_e4m3fn, scales float8_e8m0fnu, packed FP4 as int8
    with dtype='fp4_e2m1'), or numpy arrays with explicit dtype strings for the stored
    formats (uint8 codes 'fp8_e4m3' / 'e8m0' / 'fp4_e2m1', uint16 bits 'bf16')."""
    out = []
    for name, (dt, shape, buf) in sorted(fx.read_raw(model).items()):
        if as_torch:
            out.append((name, fx.to_torch(dt, shape, buf), "fp4_e2m1" if dt == "I8" else None))
        else:
            out.append((name, fx.to_numpy(dt, shape, buf), fx.ENTRY_DTYPE.get(dt)))
    return out


# -- forward ----------------------------------------------------------------------------


@needs["tiny"]
def test_forward_with_torch_cpu_tensors_equals_numpy_bitwise():
    steps = steps_for(fx.prompts("tiny"))
    with tiny_engine() as e_np, tiny_engine() as e_t:
        want = run_numpy(e_np, steps)
        for k, (tok, pos, slots, qs, rows) in enumerate(steps):
            t = [torch.from_numpy(a) if a is not None else None for a in (tok, pos, slots, qs, rows)]
            if k == 0:  # torch in -> torch out
                got = e_t.forward(*t)
                assert torch.is_tensor(got) and got.dtype == torch.float32
            elif k == 1:  # int64 tensors are range-checked and converted; caller-owned f32 output
                out = torch.full((2, e_t.vocab_size), float("nan"))
                got = e_t.forward(*[x.long() if x is not None else None for x in t], logits=out)
                assert got is out
            elif k == 2:  # bf16 output = the f32 logits rounded to nearest even
                out = torch.full((2, e_t.vocab_size), float("nan"), dtype=torch.bfloat16)
                got = e_t.forward(*t, logits=out)
                assert got is out and torch.isfinite(out.float()).all()
                assert_same_bits(out, torch.from_numpy(want[k]).to(torch.bfloat16), f"step {k} bf16")
                continue
            elif k == 3:  # numpy output buffer with torch inputs
                out = np.full((2, e_t.vocab_size), np.nan, np.float32)
                got = e_t.forward(*t, logits=out)
                assert got is out
            else:  # torch inputs that are non-contiguous views
                wide = [torch.from_numpy(np.repeat(a, 2)) if a is not None else None for a in (tok, pos, slots, qs)]
                got = e_t.forward(*[w[::2] for w in wide], rows)
            assert np.isfinite(np.asarray(got)).all()
            assert_same_bits(got, want[k], f"step {k}")


def test_forward_torch_errors_name_the_argument():
    with dsv4.Engine(load="dummy", **CAPS) as e:
        ok = [torch.tensor(v, dtype=torch.int32) for v in ([1, 2], [0, 1], [0], [0, 2])]
        with pytest.raises(dsv4.InvalidArgumentError, match="token_ids must hold integers"):
            e.forward(ok[0].float(), *ok[1:])
        with pytest.raises(dsv4.InvalidArgumentError, match="positions must be 1-D"):
            e.forward(ok[0], ok[1].reshape(1, 2), *ok[2:])
        with pytest.raises(dsv4.InvalidArgumentError, match="seq_slots is on meta"):
            e.forward(*ok[:2], torch.empty(1, dtype=torch.int32, device="meta"), ok[3])
        with pytest.raises(dsv4.InvalidArgumentError, match=r"logits has shape \(3, "):
            e.forward(*ok, logits=torch.empty(3, e.vocab_size))
        with pytest.raises(dsv4.InvalidArgumentError, match="logits has dtype torch.float16"):
            e.forward(*ok, logits=torch.empty(2, e.vocab_size, dtype=torch.float16))
        with pytest.raises(dsv4.InvalidArgumentError, match="logits is not contiguous"):
            e.forward(*ok, logits=torch.empty(e.vocab_size, 2).t())
        with pytest.raises(dsv4.InvalidArgumentError, match="logits has dtype float64"):
            e.forward(*ok, logits=np.empty((2, e.vocab_size)))
        with pytest.raises(dsv4.InvalidArgumentError, match="stream"):
            e.forward(*ok, stream="default")
        with pytest.raises(dsv4.InvalidArgumentError, match="stream"):
            e.forward(*ok, stream=True)
        with pytest.raises(dsv4.CapacityError, match="max_seq_len"):  # the library's own checks still apply
            e.forward(ok[0], torch.tensor([63, 64], dtype=torch.int32), *ok[2:])
        # Nothing above changed the engine: a forward equals a fresh engine's.
        with dsv4.Engine(load="dummy", **CAPS) as fresh:
            assert_same_bits(e.forward(*ok), fresh.forward(*ok), "after errors")


def test_stream_forms_are_accepted_on_the_cpu_backend():
    class FakeTorchStream:  # what the binding reads from a torch.cuda.Stream
        cuda_stream = 0x1234

    class ProtocolStream:
        def __cuda_stream__(self):
            return (0, 0x5678)

    ok = [torch.tensor(v, dtype=torch.int32) for v in ([1, 2], [0, 1], [0], [0, 2])]
    with dsv4.Engine(load="dummy", **CAPS) as e:
        want = e.forward(*ok)
        for s in (None, 0, np.int64(0), FakeTorchStream(), ProtocolStream()):
            assert_same_bits(e.forward(*ok, stream=s), want, f"stream={s!r}")  # ignored by the CPU
        e.finalize(stream=FakeTorchStream())
        with e.refitting(stream=ProtocolStream()):
            pass


# -- refit / load_tensor ------------------------------------------------------------------


def test_refit_from_torch_cpu_equals_numpy_bitwise():
    norm, mat = "layers.1.ffn_norm.weight", "layers.0.attn.wq_a.weight"
    rng = np.random.default_rng(7)
    ok = [np.array(v, np.int32) for v in ([5, 6, 7, 8], [0, 1, 2, 3], [0], [0, 4])]
    with dsv4.Engine(load="dummy", **CAPS) as a, dsv4.Engine(load="dummy", **CAPS) as b:
        base = a.forward(*ok)
        shapes = {n: s for n, _, s, _ in a.weights()}
        new_norm = (1 + 0.1 * rng.standard_normal(shapes[norm])).astype(np.float32)
        new_mat = (0.05 * rng.standard_normal(shapes[mat])).astype(np.float32)

        # float32: numpy on a, torch on b (the matrix as a non-contiguous transposed view).
        a.refit_many({norm: new_norm, mat: new_mat})
        b.refit_many({norm: torch.from_numpy(new_norm.copy()),
                      mat: torch.from_numpy(np.ascontiguousarray(new_mat.T)).t()})
        for n in (norm, mat):
            assert_same_bits(b.weight_array(n), a.weight_array(n), n)
        got_a, got_b = a.forward(*ok), b.forward(*ok)
        assert not np.array_equal(bits(got_a), bits(base)), "refit did not reach the forward"
        assert_same_bits(got_b, got_a, "f32 refit")

        # bfloat16: a torch bfloat16 tensor == numpy uint16 bits with dtype="bf16" ==
        # float32 values rounded by numpy (dtype="bf16") == rounded by torch on the host.
        # Include exact rounding ties (low 16 bits 0x8000) to pin round-to-nearest-even.
        f = new_mat.copy()
        f.reshape(-1)[:64].view(np.uint32)[:] = (np.arange(64, dtype=np.uint32) << 16) | 0x3F008000
        t_bf = torch.from_numpy(f).to(torch.bfloat16)
        a.refit(mat, t_bf.view(torch.int16).numpy().view(np.uint16), dtype="bf16")
        b.refit(mat, t_bf)
        assert_same_bits(b.weight_array(mat), a.weight_array(mat), "bf16 bits")
        assert_same_bits(b.forward(*ok), a.forward(*ok), "bf16 refit")
        a.refit(mat, f, dtype="bf16")
        b.refit(mat, torch.from_numpy(f), dtype="bf16")
        assert_same_bits(a.weight_array(mat), t_bf.float().numpy(), "numpy RNE vs torch RNE")
        assert_same_bits(b.weight_array(mat), t_bf.float().numpy(), "torch host conversion")

        # float64 tensors become float32, per-entry dtypes in list form, int dtype conversion.
        b.refit_many([(norm, torch.from_numpy(new_norm.astype(np.float64))), (mat, (torch.from_numpy(f), "bf16"))])
        assert_same_bits(b.weight_array(norm), new_norm, "f64 -> f32")
        assert_same_bits(b.weight_array(mat), t_bf.float().numpy(), "per-entry bf16")

        # All-or-nothing still holds with torch entries.
        with pytest.raises(dsv4.TensorError):
            b.refit_many({norm: torch.zeros(shapes[norm]), "layers.1.ffn_norm.bias_nope": torch.zeros(4)})
        assert_same_bits(b.weight_array(norm), new_norm, "after failed refit")


def test_torch_entry_errors():
    with dsv4.Engine(load="dummy", **CAPS) as e:
        name = "layers.1.ffn_norm.weight"
        with pytest.raises(dsv4.InvalidArgumentError, match="does not quantize"):
            e.refit(name, torch.zeros(4), dtype="fp8_e4m3")
        with pytest.raises(dsv4.InvalidArgumentError, match="unsupported dtype torch.uint8"):
            e.refit(name, torch.zeros(4, dtype=torch.uint8))
        with pytest.raises(dsv4.InvalidArgumentError, match="unsupported dtype uint8"):
            e.refit(name, np.zeros(4, np.uint8))
        with pytest.raises(dsv4.InvalidArgumentError, match="unknown dtype"):
            e.refit(name, torch.zeros(4), dtype="fp3")
        with pytest.raises(dsv4.InvalidArgumentError, match="is on meta"):
            e.refit(name, torch.zeros(4, device="meta"))
        with pytest.raises(dsv4.InvalidArgumentError, match="packed FP4 needs at least one dimension"):
            e.refit(name, torch.tensor(3, dtype=torch.uint8), dtype="fp4_e2m1")


def test_entries_carry_pointer_dtype_and_logical_shape():
    """What reaches the C ABI, independent of the library's minor: stored-format tensors are
    passed in place (same pointer), FP4 with the logical shape, CPU tensors as host memory."""
    codes = torch.arange(128 * 64, dtype=torch.int32).to(torch.uint8).reshape(128, 64)
    cases = [
        (codes, "fp4_e2m1", _lib.DTYPE_FP4_E2M1, (128, 128)),
        (codes.view(torch.int8), "fp4_e2m1", _lib.DTYPE_FP4_E2M1, (128, 128)),
        (codes.view(torch.float4_e2m1fn_x2), None, _lib.DTYPE_FP4_E2M1, (128, 128)),
        (codes.view(torch.float8_e4m3fn), None, _lib.DTYPE_F8_E4M3, (128, 64)),
        (codes, "fp8_e4m3", _lib.DTYPE_F8_E4M3, (128, 64)),
        (codes[:4, :2].contiguous().view(torch.float8_e8m0fnu), None, _lib.DTYPE_E8M0, (4, 2)),
        (codes[:4, :2].contiguous(), "e8m0", _lib.DTYPE_E8M0, (4, 2)),
        (torch.zeros(3, 5, dtype=torch.bfloat16), None, _lib.DTYPE_BF16, (3, 5)),
        (torch.zeros(3, 5, dtype=torch.float16), None, _lib.DTYPE_F16, (3, 5)),
        (torch.zeros(7, dtype=torch.int64), None, _lib.DTYPE_I64, (7,)),
    ]
    for value, dtype, code, shape in cases:
        t, keep, is_torch = _tensor_entry("w", value, dtype, _lib.DEVICE_CPU)
        got = (t.dtype, t.ndim, tuple(t.shape[: t.ndim]))
        assert is_torch and got == (code, len(shape), shape), (dtype, value.dtype, got)
        assert t.data == value.data_ptr() and t.memory == _lib.MEMORY_HOST
        assert ctypes.string_at(t.name) == b"w"
    u8 = codes.numpy()
    for dtype, code, shape in (("fp4_e2m1", _lib.DTYPE_FP4_E2M1, (128, 128)),
                               ("fp8_e4m3", _lib.DTYPE_F8_E4M3, (128, 64)),
                               ("e8m0", _lib.DTYPE_E8M0, (128, 64))):
        t, keep, is_torch = _tensor_entry("w", u8, dtype, _lib.DEVICE_CPU)
        assert not is_torch and (t.dtype, tuple(t.shape[: t.ndim])) == (code, shape)
        assert ctypes.string_at(t.data, u8.nbytes) == u8.tobytes()
    # A non-contiguous CPU tensor is copied to a contiguous one (kept alive with the entry).
    t, keep, _ = _tensor_entry("w", codes.t(), "fp8_e4m3", _lib.DEVICE_CPU)
    assert tuple(t.shape[:2]) == (64, 128)
    assert ctypes.string_at(t.data, 64 * 128) == codes.t().contiguous().numpy().tobytes()


@needs["tiny"]
def test_refit_every_weight_from_torch_equals_checkpoint_load():
    """RL flow with torch: dummy engine, every checkpoint tensor synced as a torch CPU tensor
    (BF16 as torch.bfloat16, tid2eid int64) in two chunks == the engine that loaded it."""
    steps = steps_for(fx.prompts("tiny"), decode=2)
    entries = checkpoint_entries("tiny")
    with tiny_engine() as ref, tiny_engine(load="dummy") as e:
        want = run_numpy(ref, steps)
        before = e.forward(*steps[0])
        assert not np.array_equal(bits(before), bits(want[0])), "dummy weights already give the logits"
        with e.refitting():
            e.refit_many(entries[: len(entries) // 2])
            e.refit_many(entries[len(entries) // 2 :])
        for k, (w, got) in enumerate(zip(want, run_numpy(e, steps))):  # step 0 restarts the slots
            assert np.isfinite(got).all()
            assert_same_bits(got, w, f"step {k}")


@needs["tiny"]
def test_load_tensor_from_torch_equals_checkpoint_load():
    steps = steps_for(fx.prompts("tiny"), decode=1)
    with tiny_engine() as ref, tiny_engine(load=None) as e:
        for name, value, dtype in checkpoint_entries("tiny"):
            e.load_tensor(name, value, dtype)
        assert e.info()["phase"] == "loaded"
        e.finalize()
        for k, (want, got) in enumerate(zip(run_numpy(ref, steps), run_numpy(e, steps))):
            assert_same_bits(got, want, f"step {k}")


# -- introspection ------------------------------------------------------------------------


def test_info_and_weight_descs_follow_the_abi_minor():
    with dsv4.Engine(load="dummy", **CAPS) as e:
        info = e.info()
        descs = e.weight_descs()
        source = [d for d in descs if not d["derived"]]
        assert e.weights() == [(d["name"], d["dtype"], d["shape"], d["data"]) for d in source]
        assert info["num_weights"] == len(descs)
        if _lib.abi_minor() < _lib.ABI_MINOR_STORED_FORMATS:
            assert not any(k in info for k in _lib.INFO_FIELDS_MINOR1)
            assert len(source) == len(descs)
            return
        for k in _lib.INFO_FIELDS_MINOR1:  # CPU backend: no single span, so no base address ...
            if k.endswith("_base"):
                assert info[k] == 0, k
        # ... but its memory figures (ABI 1.3): host buffers, no per-forward workspace.
        assert info["weights_nbytes"] > 0 and info["derived_nbytes"] > 0, info
        assert info["state_nbytes"] == info["max_num_seqs"] * info["state_slot_nbytes"] > 0, info
        assert info["workspace_nbytes"] == 0 and info["device_nbytes"] == 0, info
        # Sources first, then derived tensors; derived ones are readable on the CPU.
        flags = [d["derived"] for d in descs]
        assert flags == sorted(flags)
        for d in descs:
            assert d["device"] == "cpu" and d["data"] != 0 and d["nbytes"] > 0, d
            if d["derived"]:
                assert e.weight_array(d["name"]).nbytes == d["nbytes"], d


# -- stored formats (ABI minor >= 1) --------------------------------------------------------


@STORED
@needs["tiny_fp8"]
@pytest.mark.parametrize("source", ["torch", "numpy"])
def test_refit_every_stored_tensor_equals_checkpoint_load(source):
    """Dummy tiny_fp8 engine, then every checkpoint tensor — FP8 codes, E8M0 scales, packed FP4,
    BF16, F32, I64 — refit in its stored format: codes, scales and logits == the loaded engine."""
    steps = steps_for(fx.prompts("tiny_fp8"), decode=2)
    entries = checkpoint_entries("tiny_fp8", as_torch=source == "torch")
    with tiny_engine("tiny_fp8") as ref, tiny_engine("tiny_fp8", load="dummy") as e:
        with e.refitting():
            # Two chunks; a weight and its scale share a call (sorted: `X.scale` just before `X.weight`).
            half = len(entries) // 2
            while entries[half - 1][0].endswith(".scale"):
                half += 1
            e.refit_many(entries[:half])
            e.refit_many(entries[half:])
        quantized = 0
        for d in ref.weight_descs():
            if d["derived"]:
                continue
            n = d["name"]
            assert_same_bits(e.weight_array(n).view(np.uint8), ref.weight_array(n).view(np.uint8), n)
            if d["scale"]:
                quantized += 1
                assert_same_bits(e.weight_scales(n), ref.weight_scales(n), n + " scales")
        assert quantized == 25 + 72  # every FP8 and FP4 weight of the fixture
        for k, (want, got) in enumerate(zip(run_numpy(ref, steps), run_numpy(e, steps))):
            assert np.isfinite(got).all()
            assert_same_bits(got, want, f"step {k}")


@STORED
@needs["tiny_fp8"]
def test_refit_one_fp8_and_one_fp4_weight_round_trip():
    """Perturb an FP8 and an FP4 weight (codes + scale), check the engine holds exactly what
    was sent, then restore the checkpoint's values as torch fp8/e8m0 (and F32 scales)."""
    raw = fx.read_raw("tiny_fp8")
    fp8, fp4 = "layers.0.attn.wq_b", "layers.1.ffn.experts.3.w2"
    t = {n: fx.to_torch(*raw[n]) for n in (f"{fp8}.weight", f"{fp8}.scale", f"{fp4}.weight", f"{fp4}.scale",
                                           "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale")}
    steps = steps_for(fx.prompts("tiny_fp8"), decode=1)
    with tiny_engine("tiny_fp8") as ref, tiny_engine("tiny_fp8") as e:
        want = run_numpy(ref, steps)
        # Perturbed: layer 1's wq_b codes and scale into layer 0; FP4 codes reversed by row
        # with the scale exponents lowered by one (every scale halves).
        p8, s8 = t["layers.1.attn.wq_b.weight"], t["layers.1.attn.wq_b.scale"]
        p4 = t[f"{fp4}.weight"].flip(0).contiguous()
        s4 = (t[f"{fp4}.scale"].view(torch.uint8) - 1).view(torch.float8_e8m0fnu)
        e.refit_many({f"{fp8}.weight": p8, f"{fp8}.scale": s8,
                      f"{fp4}.weight": (p4, "fp4_e2m1"), f"{fp4}.scale": s4})
        np.testing.assert_array_equal(e.weight_array(f"{fp8}.weight"), p8.view(torch.uint8).numpy())
        np.testing.assert_array_equal(e.weight_array(f"{fp4}.weight"), p4.view(torch.uint8).numpy())
        np.testing.assert_array_equal(e.weight_scales(f"{fp8}.weight"), s8.float().numpy())
        np.testing.assert_array_equal(e.weight_scales(f"{fp4}.weight"), s4.float().numpy())
        changed = run_numpy(e, steps)
        assert not np.array_equal(bits(changed[0]), bits(want[0])), "perturbed weights did not reach the forward"
        # Restore from the checkpoint: E8M0 scales, then again with the scales as F32 values.
        for scale_fmt in ("e8m0", "f32"):
            conv = (lambda s: s) if scale_fmt == "e8m0" else (lambda s: s.float())
            e.refit_many({f"{fp8}.weight": t[f"{fp8}.weight"], f"{fp8}.scale": conv(t[f"{fp8}.scale"]),
                          f"{fp4}.weight": (t[f"{fp4}.weight"], "fp4_e2m1"), f"{fp4}.scale": conv(t[f"{fp4}.scale"])})
            for n in (f"{fp8}.weight", f"{fp4}.weight"):
                np.testing.assert_array_equal(e.weight_array(n), ref.weight_array(n))
                assert_same_bits(e.weight_scales(n), ref.weight_scales(n), n)
            for slot in (0, 1):
                e.release(slot)
            for k, (w, g) in enumerate(zip(want, run_numpy(e, steps))):
                assert_same_bits(g, w, f"{scale_fmt} step {k}")

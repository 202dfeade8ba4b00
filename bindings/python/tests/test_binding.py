"""pytest for the ctypes binding (bindings/python/dsv4) on the CPU backend.

Run with DSV4_LIBRARY pointing at a built libdsv4.so (or build target/debug first):

    DSV4_LIBRARY=target/debug/libdsv4.so pytest bindings/python/tests
"""

import threading
from pathlib import Path

import numpy as np
import pytest

import dsv4

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tiny"
CAPS = dict(max_num_seqs=4, max_num_tokens=32, max_seq_len=64, num_threads=2, numerics="exact")


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(load="dummy", **CAPS) as e:
        yield e


def run_prompt(e, slot, tokens, start=0, last_only=False):
    n = len(tokens)
    return e.forward(
        token_ids=tokens,
        positions=list(range(start, start + n)),
        seq_slots=[slot],
        query_start=[0, n],
        logits_rows=[n - 1] if last_only else None,
    )


def test_library_and_versions():
    major, minor = dsv4.abi_version()
    assert (major, minor) >= (1, 0) and major == 1
    assert dsv4.version().startswith("dsv4 ")
    assert Path(dsv4.library_path()).is_file()


def test_info_of_dummy_engine(engine):
    i = engine.info()
    assert i["phase"] == "ready"
    assert i["device"] == "cpu"
    assert i["numerics"] == "exact"
    assert (i["max_num_seqs"], i["max_num_tokens"], i["max_seq_len"]) == (4, 32, 64)
    assert i["vocab_size"] == engine.vocab_size == 1024
    # num_weights counts derived tensors too (ABI minor >= 1); weights() lists source weights.
    assert i["num_weights"] == len(engine.weight_descs())
    assert len(engine.weights()) == sum(not d["derived"] for d in engine.weight_descs())


def test_info_token_ids_and_derived_dtypes(engine):
    """ABI 1.3: the config's bos/eos ids are in info; derived f64 tensors are named "f64"."""
    i = engine.info()
    cfg_bos, cfg_eos = 0, 1  # the embedded tiny config's (DeepSeek-V4's) ids
    assert (i["bos_token_id"], i["eos_token_id"]) == (cfg_bos, cfg_eos)
    derived = [d for d in engine.weight_descs() if d["derived"]]
    assert derived, "the engine lists its derived tensors"
    assert all(isinstance(d["dtype"], str) and not d["dtype"].isdigit() for d in derived), derived
    assert "f64" in {d["dtype"] for d in derived}


def test_plan_memory_equals_the_created_engines_figures():
    """dsv4.plan_memory (ABI 1.3) gives, without creating anything, the figures info() then
    reports; the state grows by exactly one slot's bytes per slot on the CPU."""
    keys = ("weights_nbytes", "derived_nbytes", "state_nbytes", "state_slot_nbytes",
            "workspace_nbytes", "device_nbytes", "host_nbytes")
    args = dict(max_num_seqs=3, max_num_tokens=16, max_seq_len=48)
    plan = dsv4.plan_memory(str(FIXTURE), **args)
    with dsv4.Engine(str(FIXTURE), **args) as e:
        info = e.info()
    assert {k: info[k] for k in keys} == plan
    assert plan["state_nbytes"] == 3 * plan["state_slot_nbytes"] > 0
    big = dsv4.plan_memory(str(FIXTURE), max_num_seqs=4096, max_num_tokens=16, max_seq_len=48)
    assert big["state_nbytes"] == 4096 * plan["state_slot_nbytes"]
    with pytest.raises(dsv4.InvalidArgumentError, match="max_num_seqs"):
        dsv4.plan_memory(str(FIXTURE), max_num_seqs=0)


def test_forward_shapes_and_finite(engine):
    logits = run_prompt(engine, 0, [1, 2, 3, 4, 5])
    assert logits.shape == (5, engine.vocab_size)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    # Decode one more token in the same slot, then two sequences in one batch.
    step = run_prompt(engine, 0, [6], start=5)
    assert step.shape == (1, engine.vocab_size)
    two = engine.forward([1, 2, 3, 7, 8], [0, 1, 2, 0, 1], [1, 2], [0, 3, 5], logits_rows=[2, 4])
    assert two.shape == (2, engine.vocab_size) and np.isfinite(two).all()
    # logits_rows selects rows of the full output.
    full = run_prompt(engine, 3, [1, 2, 3, 4, 5])
    last = run_prompt(engine, 3, [1, 2, 3, 4, 5], last_only=True)
    np.testing.assert_allclose(last[0], full[4], rtol=0, atol=1e-4)
    # Deterministic: the same prompt in another slot gives the same logits.
    np.testing.assert_allclose(run_prompt(engine, 2, [1, 2, 3, 4, 5]), full, rtol=0, atol=1e-5)


def test_errors_carry_status_and_message(engine):
    with pytest.raises(dsv4.CapacityError) as ei:
        run_prompt(engine, 0, [1], start=64)
    assert ei.value.status == 8 and ei.value.status_name == "CAPACITY"
    assert "max_seq_len" in ei.value.message and "positions" in ei.value.message
    assert isinstance(ei.value, dsv4.Error)

    with pytest.raises(dsv4.CapacityError, match="max_num_tokens"):
        run_prompt(engine, 1, list(range(33)))
    with pytest.raises(dsv4.InvalidArgumentError, match=r"token_ids\[0\]"):
        run_prompt(engine, 1, [5000])
    with pytest.raises(dsv4.InvalidArgumentError, match="seq_slots"):
        run_prompt(engine, 9, [1])
    with pytest.raises(dsv4.InvalidArgumentError, match="query_start"):
        engine.forward([1, 2], [0, 1], [0], [0, 1, 2])
    with pytest.raises(dsv4.InvalidArgumentError, match="slot"):
        engine.release(17)
    with pytest.raises(dsv4.TensorError, match="no_such_weight"):
        engine.refit("layers.0.no_such_weight", np.zeros(4, np.float32))
    # The engine still works after all of that.
    assert np.isfinite(run_prompt(engine, 1, [3, 4])).all()


def test_create_errors():
    with pytest.raises(dsv4.ConfigError, match="JSON"):
        dsv4.Engine(config_json="{not json", load="dummy", **CAPS)
    with pytest.raises(dsv4.IoError, match="/nonexistent"):
        dsv4.Engine(model_dir="/nonexistent/model", load="dummy", **CAPS)
    with pytest.raises(dsv4.InvalidArgumentError, match="max_num_seqs"):
        dsv4.Engine(load="dummy", max_num_seqs=0)
    with pytest.raises(dsv4.InvalidArgumentError, match="numerics"):
        dsv4.Engine(load="dummy", numerics="fp3")
    with pytest.raises(dsv4.InvalidArgumentError, match="device"):
        dsv4.Engine(load="dummy", device="tpu")
    with pytest.raises(dsv4.InvalidArgumentError, match="model_dir"):
        dsv4.Engine(load="auto")
    # device 0: a runnable CUDA engine where there is a GPU, else NO_DEVICE / CUDA / UNSUPPORTED.
    try:
        with dsv4.Engine(load="dummy", device="cuda:0", **CAPS) as e:
            assert e.info()["device"] == "cuda:0"
    except dsv4.Error as err:
        assert err.status in (9, 10, 11), err


def test_refit_round_trip(engine):
    name = "layers.1.ffn_norm.weight"
    before = engine.weight_array(name).copy()
    ptr_before = dict((n, p) for n, _, _, p in engine.weights())[name]
    base = run_prompt(engine, 0, [9, 8, 7])

    new = np.linspace(0.5, 1.5, before.size, dtype=np.float32).reshape(before.shape)
    engine.refit(name, new)
    np.testing.assert_array_equal(engine.weight_array(name), new)
    assert dict((n, p) for n, _, _, p in engine.weights())[name] == ptr_before, "refit moved the weight"
    changed = run_prompt(engine, 0, [9, 8, 7])
    assert not np.allclose(changed, base), "refit did not change the logits"

    # All-or-nothing: one bad entry leaves the good one unwritten.
    with pytest.raises(dsv4.TensorError):
        engine.refit_many({name: before, "layers.1.ffn_norm.bias_nope": before})
    np.testing.assert_array_equal(engine.weight_array(name), new)
    with pytest.raises(dsv4.TensorError, match=name):
        engine.refit(name, before[: before.size // 2])

    # Restore (bf16 input path for float values exactly representable in bf16 is lossless).
    engine.refit_many([(name, before)])
    np.testing.assert_array_equal(engine.weight_array(name), before)
    np.testing.assert_allclose(run_prompt(engine, 0, [9, 8, 7]), base, rtol=0, atol=1e-5)
    halves = np.full(before.shape, 0.5, dtype=np.float32)
    engine.refit(name, halves, dtype="bf16")
    np.testing.assert_array_equal(engine.weight_array(name), halves)
    engine.refit(name, before)


def test_refitting_aborts_on_an_exception_keeping_the_written_chunks():
    """An exception inside ``refitting()`` aborts the refit (dsv4_refit_abort): it propagates,
    the chunks written so far stay written, and the engine is ready again."""
    with dsv4.Engine(load="dummy", **CAPS) as e:
        a, b = "layers.1.ffn_norm.weight", "layers.0.ffn_norm.weight"
        before_b = e.weight_array(b).copy()
        new_a = np.full(e.weight_array(a).shape, 0.75, dtype=np.float32)
        with pytest.raises(RuntimeError, match="host failed midway"):
            with e.refitting():
                e.refit(a, new_a)
                raise RuntimeError("host failed midway")
        assert e.info()["phase"] == "ready"
        np.testing.assert_array_equal(e.weight_array(a), new_a)
        np.testing.assert_array_equal(e.weight_array(b), before_b)
        assert np.isfinite(run_prompt(e, 0, [1, 2, 3])).all()
        with pytest.raises(dsv4.StateError, match="dsv4_refit_abort"):
            e.refit_abort()


def test_release_restarts_slot(engine):
    run_prompt(engine, 2, [1, 2, 3])
    assert engine.slot_length(2) == 3
    run_prompt(engine, 2, [4], start=3)  # continues
    assert engine.slot_length(2) == 4
    engine.release(2)
    assert engine.slot_length(2) == 0
    with pytest.raises(dsv4.InvalidArgumentError, match="slot"):
        engine.slot_length(4)
    with pytest.raises(dsv4.InvalidArgumentError, match="slot 2"):
        run_prompt(engine, 2, [5], start=4)
    assert np.isfinite(run_prompt(engine, 2, [1])).all()


def test_weights_listing(engine):
    ws = engine.weights()
    names = [w[0] for w in ws]
    assert len(set(names)) == len(names)
    assert "embed.weight" in names
    for name, dtype, shape, ptr in ws:
        assert dtype in ("f32", "i32", "bf16", "f16", "i64")
        assert all(d > 0 for d in shape) and ptr != 0


def test_close_and_context_manager():
    e = dsv4.Engine(load="dummy", **CAPS)
    e.close()
    e.close()  # idempotent
    assert e.closed
    with pytest.raises(dsv4.StateError, match="closed"):
        e.info()
    with dsv4.Engine(load="dummy", **CAPS) as e2:
        assert not e2.closed
    assert e2.closed


def test_streaming_load_then_finalize():
    with dsv4.Engine(load=None, **CAPS) as e:
        assert e.info()["phase"] == "created"
        with pytest.raises(dsv4.StateError, match="dsv4_finalize"):
            e.finalize()
        with dsv4.Engine(load="dummy", **CAPS) as src:
            # BF16-stored weights (the head, the compressors) come as uint16 bits: say so.
            for name, dtype, _, _ in src.weights():
                e.load_tensor(name, src.weight_array(name), dtype="bf16" if dtype == "bf16" else None)
        assert e.info()["phase"] == "loaded"
        e.finalize()
        assert np.isfinite(run_prompt(e, 0, [1, 2])).all()


def test_load_tensors_takes_stored_format_pairs_in_one_call():
    """dsv4_load_tensors (ABI 1.4): every weight in one call, FP8/FP4 codes with their scale
    entries, gives the engine the source engine's weights and logits, bit for bit."""
    caps = dict(CAPS, weight_format="quantize", numerics="official")
    with dsv4.Engine(load="dummy", **caps) as src, dsv4.Engine(load=None, **caps) as e:
        kinds = {"f8_e4m3": "fp8_e4m3", "fp4_e2m1": "fp4_e2m1"}
        entries = []
        for name, dtype, _, _ in src.weights():
            if dtype in kinds:
                entries.append((name, src.weight_array(name), kinds[dtype]))
                scale = name[: -len(".weight")] + ".scale"
                entries.append((scale, src.weight_scales(name).astype(np.float32), None))
            else:
                entries.append((name, src.weight_array(name), "bf16" if dtype == "bf16" else None))
        assert any(k == "fp4_e2m1" for _, _, k in entries), "the quantize format holds FP4 experts"
        e.load_tensors(entries)
        assert e.info()["phase"] == "loaded"
        e.finalize()
        want = run_prompt(src, 0, [1, 2, 3])
        assert np.array_equal(run_prompt(e, 0, [1, 2, 3]).view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not (FIXTURE / "model.safetensors").is_file(), reason="no checkpoint fixture")
def test_checkpoint_fixture_loads():
    with dsv4.Engine(model_dir=str(FIXTURE), **CAPS) as e:
        assert e.info()["phase"] == "ready"
        logits = run_prompt(e, 0, [1, 2, 3, 4], last_only=True)
        assert logits.shape == (1, e.vocab_size) and np.isfinite(logits).all()


def test_log_callback():
    got = []
    dsv4.set_log_callback(lambda level, msg: got.append((level, msg)), level="debug")
    try:
        # Official numerics on the CPU reference logs a warning at create (if it still does);
        # either way the callback path must not break anything.
        with dsv4.Engine(load="dummy", **{**CAPS, "numerics": "official"}):
            pass
    finally:
        dsv4.set_log_callback(None)
    assert all(isinstance(level, str) and isinstance(msg, str) for level, msg in got)
    with pytest.raises(dsv4.InvalidArgumentError):
        dsv4.set_log_callback(None, level="loud")


def test_engines_in_threads_are_independent():
    results = {}

    def work(k):
        with dsv4.Engine(load="dummy", **CAPS) as e:
            results[k] = run_prompt(e, 0, [1, 2, 3])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(results[0], results[1])


def test_numpy_paths_never_import_torch():
    """torch is optional: importing dsv4 and the numpy paths must not import it."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, dsv4\n"
        "e = dsv4.Engine(load='dummy', max_num_seqs=1, max_num_tokens=8, max_seq_len=16, num_threads=1)\n"
        "e.forward([1, 2], [0, 1], [0], [0, 2], stream=0)\n"
        "e.refit('layers.1.ffn_norm.weight', e.weight_array('layers.1.ffn_norm.weight'))\n"
        "assert 'torch' not in sys.modules, 'dsv4 imported torch'\n"
    )
    pkg = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", code], cwd=pkg, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_padding_slot_gives_zero_rows_and_touches_no_state():
    """DSV4_PAD_SLOT sequences (any positions) beside real ones: the real rows equal the
    unpadded batch bit for bit on a twin engine, the padding rows are zeros, and both
    engines' slots continue identically afterwards."""
    assert dsv4.PAD_SLOT == -1
    with dsv4.Engine(load="dummy", **CAPS) as a, dsv4.Engine(load="dummy", **CAPS) as twin:
        real = [5, 6, 7]
        pad = [11, 12]
        got = a.forward(token_ids=pad + real, positions=[2**30, -4, 0, 1, 2],
                        seq_slots=[dsv4.PAD_SLOT, 0], query_start=[0, 2, 5])
        want = twin.forward(token_ids=real, positions=[0, 1, 2], seq_slots=[0], query_start=[0, 3])
        assert (got[:2] == 0).all()
        assert got[2:].tobytes() == want.tobytes()
        nxt = run_prompt(a, 0, [9], start=3)
        assert nxt.tobytes() == run_prompt(twin, 0, [9], start=3).tobytes()
        # Nothing is recorded on the CPU backend: forward raised or succeeded already.
        assert a.device_error() is None
        assert a.info()["device_error"] == 0
        with pytest.raises(dsv4.InvalidArgumentError, match=r"seq_slots\[0\] = -2"):
            a.forward(token_ids=[1], positions=[0], seq_slots=[-2], query_start=[0, 1])


def test_kernel_set_option():
    """`reference` is accepted on every backend; a set the build lacks is a CONFIG error
    naming it."""
    with dsv4.Engine(load="dummy", kernel_set="reference", **CAPS) as e:
        assert e.info()["phase"] == "ready"
    with pytest.raises(dsv4.ConfigError, match=r"kernel_set = `warp9` does not exist.*reference"):
        dsv4.Engine(load="dummy", kernel_set="warp9", **CAPS)

"""bench/musts.py on made-up result files (the rules) and on the committed ones (it reads them)."""
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import musts  # noqa: E402


def write(tmp_path, name, cases, gpu="NVIDIA H200"):
    p = tmp_path / name
    p.write_text(json.dumps({"date": "x", "gpu": gpu, "ceilings": {}, "cases": cases}))
    return str(p)


def moe(b, path, time, hbm, fp8=None, torch=None, routing="uniform"):
    c = {"bench": "moe", "B": b, "routing": routing, "path": path, "time_us": time,
         "fraction_of_hbm": hbm}
    if fp8 is not None:
        c["fraction_of_fp8_peak"] = fp8
    if torch is not None:
        c["speedup_vs_torch"] = torch
    return c


def test_moe_takes_each_batch_size_fastest_path_and_the_newest_run(tmp_path):
    old = write(tmp_path, "a.json", [moe(1, "decode", 30.0, 0.80, torch=25.0)])
    new = write(tmp_path, "b.json", [
        moe(1, "decode", 58.0, 0.43, torch=13.7),
        moe(1, "decode-fused", 60.0, 0.41, torch=13.0),  # slower path: not the one judged
        moe(4096, "prefill", 2275.0, 0.05, fp8=0.44, torch=3.1),
    ])
    r = musts.standing([old, new])
    dec = r["11 decode >= 75% HBM (B <= 256)"]
    assert [c["value"] for c in dec["cases"]] == [0.43]  # b.json's, its faster path
    assert dec["cases"][0]["file"] == new and not dec["met"]
    assert r["11 prefill >= 50% FP8 peak (B >= 4096)"]["cases"][0]["value"] == 0.44
    assert not r["11 >= 20x torch (B <= 8)"]["met"]
    assert r["11 >= 4x torch (B >= 64)"]["cases"][0]["value"] == 3.1
    # Only the older run: its numbers, and the must met.
    assert musts.standing([old])["11 decode >= 75% HBM (B <= 256)"]["met"]


def test_torch_cases_state_what_a_layer_at_its_floor_would_reach(tmp_path):
    at = dict(moe(8, "decode", 230.0, 0.87, torch=5.7), torch_grouped_mm_us=1340.0, floor_us=200.0)
    hi = dict(moe(16384, "prefill", 8555.0, 0.13, fp8=0.48, torch=2.55), torch_grouped_mm_us=21780.0,
              floor_us=4140.0)
    bare = moe(64, "decode", 900.0, 0.95, torch=4.4)  # a file without the floor: no ceiling stated
    f = write(tmp_path, "t.json", [at, hi, bare])
    r = musts.standing([f])
    lo = r["11 >= 20x torch (B <= 8)"]["cases"][0]
    assert lo["at_floor"] == 6.7 and lo["asks"] == round(20 / 6.7, 3) and lo["asks"] > 1
    by_b = {c["case"].split(" ")[2]: c for c in r["11 >= 4x torch (B >= 64)"]["cases"]}
    assert by_b["16384"]["asks"] == round(4 / (21780.0 / 4140.0), 3)
    assert "at_floor" not in by_b["64"] and by_b["64"]["met"]


def test_each_gpu_is_judged_on_its_own_newest_run(tmp_path):
    h200 = write(tmp_path, "a.json", [moe(8, "decode", 200.0, 0.72)])
    h100 = write(tmp_path, "b.json", [moe(8, "decode", 240.0, 0.85)], gpu="NVIDIA H100 80GB HBM3")
    dec = musts.standing([h200, h100])["11 decode >= 75% HBM (B <= 256)"]
    # The H100's newer run does not hide the H200's: each machine against its own ceiling.
    assert {g: m["met"] for g, m in dec["by_gpu"].items()} == {"H100": True, "H200": False}
    assert [c["gpu"] for c in dec["cases"]] == ["H100", "H200"] and not dec["met"]
    assert musts.standing([h100])["11 decode >= 75% HBM (B <= 256)"]["met"]
    assert musts.gpu_kind(None) == "unknown" and musts.gpu_kind("NVIDIA B200") == "NVIDIA B200"


def dense(name, t, path, hbm, fp8, fmt="fp8", act=True, bf16=None):
    c = {"bench": "dense", "projection": name, "format": fmt, "T": t, "path": path,
         "act_in_gemv": act, "time_us": 1.0, "fraction_of_hbm": hbm, "fraction_of_fp8_peak": fp8}
    if bf16 is not None:
        c["fraction_of_bf16_peak"] = bf16
    return c


def test_dense_musts_read_the_paths_the_fast_set_runs(tmp_path):
    f = write(tmp_path, "d.json", [
        dense("wq_b", 1, "gemv", 0.756, 0.0),
        dense("wq_b", 1, "gemv", 0.685, 0.0, act=False),  # operands by a separate kernel
        dense("wo_b", 1, "gemv", 0.659, 0.0),
        dense("head", 1, "gemv", 1.016, 0.0, fmt="bf16"),
        dense("wq_b", 8192, "cublaslt", 0.0, 0.74),
        dense("wq_b", 8192, "own_fp8_gemm", 0.0, 0.80),  # not the fast set's GEMM
        dense("wq_b", 8192, "cublaslt_gemm_only", 0.0, 0.90),  # a GEMM alone is not a call
        dense("wq_b", 2048, "cublaslt", 0.0, 0.10),  # not the file's largest T
        dense("compressor.wkv", 8192, "cublaslt", 0.0, 0.30, fmt="bf16", bf16=0.72),
        # wo_a: FP8 storage, a BF16 einsum: judged on the BF16 peak.
        dict(dense("wo_a", 8192, "cublaslt", 0.0, 0.36, bf16=0.71), groups=8),
    ])
    r = musts.standing([f])
    dec = r["12 decode projections >= 75% HBM (T = 1)"]
    assert sorted(c["value"] for c in dec["cases"]) == [0.659, 0.756] and not dec["met"]
    assert r["12 head >= 85% HBM (T = 1)"]["met"]
    pre = r["12 prefill projections >= 70% of peak"]
    assert sorted(c["value"] for c in pre["cases"]) == [0.71, 0.72, 0.74] and pre["met"]


def test_a_grouped_projection_without_its_bf16_ratio_takes_the_files_bf16_ceiling(tmp_path):
    p = tmp_path / "g.json"
    wo_a = dict(dense("wo_a", 8192, "cublaslt", 0.0, 0.28), groups=8, flops=5.5e11, time_us=1375.0)
    p.write_text(json.dumps({"date": "x", "ceilings": {"bf16_flop_per_s": 8.0e14}, "cases": [wo_a]}))
    pre = musts.standing([str(p)])["12 prefill projections >= 70% of peak"]
    # 5.5e11 flop in 1375 us = 4.0e14 flop/s, half the BF16 ceiling.
    assert [c["value"] for c in pre["cases"]] == [0.5] and not pre["met"]


def attn(layer, kernel, ctx, t, time, floor):
    return {"bench": "attn", "layer": layer, "kernel": kernel, "context": ctx, "T": t,
            "time_us": time, "byte_floor_us": floor}


def test_attention_and_indexer_add_their_floors_and_times(tmp_path):
    f = write(tmp_path, "t.json", [
        attn("csa", "fast", 65536, 64, 63.78, 7.61),
        attn("csa", "indexer_fast", 65536, 64, 144.09, 17.07),
        attn("hca", "fast", 65536, 64, 10.0, 7.5),
        attn("csa", "fast", 262144, 64, 1.0, 1.0),  # past 64K: not the must's
        # A work-split sweep's line (chunk_keys) is not the fast set's call, nor another kernel's.
        dict(attn("csa", "indexer_fast", 65536, 64, 1.0, 17.07), chunk_keys=64),
        attn("csa", "indexer_fast_fold_tc", 65536, 64, 2.0, 17.07),
    ])
    cases = musts.standing([f])["12 attention + indexer >= 70% HBM (8K-64K)"]["cases"]
    got = {c["case"].split(" (")[0]: c["value"] for c in cases}
    assert got == {"csa 64K T = 64": round(24.68 / 207.87, 3), "hca 64K T = 64": 0.75}


def test_no_data_is_not_met(tmp_path):
    r = musts.standing([write(tmp_path, "e.json", [])])
    assert all(not m["met"] and not m["cases"] for m in r.values())


def test_the_committed_results_read():
    files = sorted(glob.glob(os.path.join(HERE, "..", "results", "*.json")))
    r = musts.standing(files)
    assert set(r) == set(musts.MUSTS)
    assert any(m["cases"] for m in r.values())

#!/usr/bin/env python3
"""Where the open issues' performance musts stand, read from `dsv4 bench` result files.

The files are the JSON documents the *_baseline.py scripts write under bench/results/ (ceilings
and PyTorch baselines measured in the same run as the cases, each case with its ratios). Nothing
here is measured: this reads the ratios those runs recorded and sets each beside its must
(PERF.md "must"; the issues' "Must show"), so a claim in BENCHMARKS.md or an issue note can be
checked against the data it cites.

Each must is judged per GPU (the file's `gpu`: "H100", "H200", else as written; the ratios are to
that machine's own ceilings, and the same kernel stands differently on each: an H100's HBM is
slower, its tensor cores are not) on the NEWEST file of that GPU that has any of its cases (one
bench run, one build: cases an older run measured and a newer one did not are not mixed in), files
ordered by the time git added them (files git does not know come last, in the order given). A must
is met on a GPU only if every case of that file is, and met only if it is met on every GPU with
data.

- Issue 11 (`bench: moe`): decode B <= 256 at >= 75% of HBM on touched-expert bytes, prefill
  B >= 4096 at >= 50% of the FP8 peak, each batch size's fastest path in the file (the path the
  fast set's crossover should pick); >= 4x torch `_grouped_mm` at B >= 64 and >= 20x at B <= 8.
  Each torch case also gets its ceiling ("at_floor"): PyTorch's time over the layer's floor (its
  touched bytes at the in-run HBM ceiling or its FLOPs at the in-run FP8 peak), the ratio a layer
  at 100% of the roofline would reach. Where it is below the must's ratio, no kernel running at
  the measured ceilings meets the must; above, the must asks threshold / at_floor of the roofline
  ("asks").
- Issue 12 (`bench: dense`, `bench: attn`): decode projections (T = 1, the gemv with its
  operands made inside it, as the fast set runs them) >= 75% of HBM on weight bytes; the head at
  T = 1 >= 85%; prefill projections (the file's largest T, >= 2048; whole calls as the fast set
  runs them: `cublaslt`; our FP8 GEMM lost to it, BENCHMARKS.md 2026-12-05) >= 70% of the FP8 peak (BF16 weights, and
  grouped projections, wo_a, whose official operation is a BF16 einsum: of the BF16 peak, from the
  file's ceilings where an older file did not record the ratio); sparse attention + indexer at decode, contexts 8K-64K, >= 70% of HBM on the
  bytes both gather (CSA: the byte floors of `fast` and `indexer_fast` over their summed times;
  HCA: `fast` alone).

usage: musts.py FILE [FILE ...] [--json]
"""
import json
import os
import subprocess
import sys

# (name, threshold) per must.
MUSTS = {
    "11 decode >= 75% HBM (B <= 256)": 0.75,
    "11 prefill >= 50% FP8 peak (B >= 4096)": 0.50,
    "11 >= 4x torch (B >= 64)": 4.0,
    "11 >= 20x torch (B <= 8)": 20.0,
    "12 decode projections >= 75% HBM (T = 1)": 0.75,
    "12 head >= 85% HBM (T = 1)": 0.85,
    "12 prefill projections >= 70% of peak": 0.70,
    "12 attention + indexer >= 70% HBM (8K-64K)": 0.70,
}


def added_at(path):
    """When git added `path` (seconds), or None: the order of the result files' measurements
    (their names and `date` fields do not order a day's files)."""
    full = os.path.abspath(path)
    try:
        log = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", full],
                             capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(full)).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(log[-1]) if log else None


# Each loaded file's in-run ceilings ({"fp8_flop_per_s": ..., ...}), by path.
CEILINGS = {}
# Each loaded file's GPU (gpu_kind), by path.
GPUS = {}


def gpu_kind(name):
    """The GPU a result file names, as the musts are grouped: "H100" or "H200" (any variant's
    name: "NVIDIA H100 80GB HBM3"), else the name as written ("unknown" if none)."""
    name = str(name or "unknown")
    for kind in ("H100", "H200"):
        if kind in name:
            return kind
    return name


def load(paths):
    """Every case of every file, as (file, case), oldest file first (added_at); the files'
    ceilings into CEILINGS."""
    order = {p: i for i, p in enumerate(paths)}
    known = {p: added_at(p) for p in paths}
    paths = sorted(paths, key=lambda p: (known[p] is None, known[p] or 0, order[p]))
    out = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        GPUS[p] = gpu_kind(doc.get("gpu") if isinstance(doc, dict) else None)
        if isinstance(doc, dict) and isinstance(doc.get("ceilings"), dict):
            CEILINGS[p] = doc["ceilings"]
        if isinstance(doc, dict) and isinstance(doc.get("cases"), list):
            out.extend((p, c) for c in doc["cases"] if isinstance(c, dict))
    return out


def newest(rows):
    """rows: (key, value, label, file[, at_floor]) in file order (load's). Per GPU (GPUS), the
    rows of that GPU's last file that has any, by key (a key twice in that file: its last):
    {gpu: {key: (value, label, file, at_floor or None)}}."""
    last = {}
    for row in rows:
        last[GPUS.get(row[3], "unknown")] = row[3]
    return {
        gpu: {row[0]: (row[1], row[2], row[3], row[4] if len(row) > 4 else None)
              for row in rows if row[3] == file}
        for gpu, file in last.items()
    }


def torch_at_floor(c):
    """The speedup over PyTorch a layer at its floor would have (`torch_grouped_mm_us` over
    `floor_us`, the bench's roofline time from the run's own ceilings), or None."""
    t, f = c.get("torch_grouped_mm_us"), c.get("floor_us")
    if not isinstance(t, (int, float)) or not isinstance(f, (int, float)) or f <= 0:
        return None
    return t / f


def moe_rows(cases):
    """Issue 11: per (B, routing) the fastest path's ratios."""
    best = {}
    for path, c in cases:
        if c.get("bench") != "moe" or "fraction_of_hbm" not in c or "B" not in c:
            continue
        key = (c["B"], c.get("routing", ""))
        prev = best.get((path, key))
        if prev is None or c["time_us"] < prev["time_us"]:
            best[(path, key)] = c
    decode, prefill, torch_lo, torch_hi = [], [], [], []
    for (path, (b, routing)), c in best.items():
        label = f"B = {b} {routing} ({c.get('path', '?')}, {c['time_us']} us)"
        if b <= 256:
            decode.append(((b, routing), c["fraction_of_hbm"], label, path))
        if b >= 4096 and "fraction_of_fp8_peak" in c:
            prefill.append(((b, routing), c["fraction_of_fp8_peak"], label, path))
        if "speedup_vs_torch" in c:
            cap = torch_at_floor(c)
            if b >= 64:
                torch_hi.append(((b, routing), c["speedup_vs_torch"], label, path, cap))
            if b <= 8:
                torch_lo.append(((b, routing), c["speedup_vs_torch"], label, path, cap))
    return {
        "11 decode >= 75% HBM (B <= 256)": newest(decode),
        "11 prefill >= 50% FP8 peak (B >= 4096)": newest(prefill),
        "11 >= 4x torch (B >= 64)": newest(torch_hi),
        "11 >= 20x torch (B <= 8)": newest(torch_lo),
    }


def prefill_fraction(path, c):
    """A many-token projection's fraction of its tensor core's peak, or None: the BF16 peak for
    BF16 weights and for grouped projections (wo_a: a BF16 einsum in the official model, FP8
    storage or not), the FP8 peak otherwise. A grouped line of a file written before the baseline
    recorded its BF16 ratio gets it from the file's BF16 ceiling."""
    if c.get("format") == "bf16":
        return c.get("fraction_of_bf16_peak")
    if c.get("groups", 1) != 1:
        if "fraction_of_bf16_peak" in c:
            return c["fraction_of_bf16_peak"]
        peak16 = CEILINGS.get(path, {}).get("bf16_flop_per_s")
        if peak16 and c.get("flops") and c.get("time_us"):
            return round(c["flops"] / (c["time_us"] * 1e-6) / peak16, 4)
        return None
    return c.get("fraction_of_fp8_peak")


def dense_rows(cases):
    """Issue 12's projections: decode at T = 1, the head, prefill at each file's largest T."""
    decode, head, prefill = [], [], []
    largest = {}
    for path, c in cases:
        if c.get("bench") == "dense" and "T" in c:
            largest[path] = max(largest.get(path, 0), c["T"])
    whole = {}
    for path, c in cases:
        if c.get("bench") != "dense" or "projection" not in c or "fraction_of_hbm" not in c:
            continue
        name, t = c["projection"], c["T"]
        if t == 1 and c.get("path") == "gemv" and c.get("act_in_gemv"):
            label = f"{name} ({c['time_us']} us)"
            row = (name, c["fraction_of_hbm"], label, path)
            (head if name == "head" else decode).append(row)
        if t == largest[path] and t >= 2048 and c.get("path") == "cublaslt":
            value = prefill_fraction(path, c)
            if value is not None:
                prev = whole.get((path, name))
                if prev is None or value > prev[1]:
                    label = f"{name} T = {t} ({c['path']}, {c['time_us']} us)"
                    whole[(path, name)] = (name, value, label, path)
    prefill = list(whole.values())
    return {
        "12 decode projections >= 75% HBM (T = 1)": newest(decode),
        "12 head >= 85% HBM (T = 1)": newest(head),
        "12 prefill projections >= 70% of peak": newest(prefill),
    }


def attn_rows(cases):
    """Issue 12's attention + indexer at decode, contexts 8K-64K."""
    by = {}
    for path, c in cases:
        if c.get("bench") != "attn" or not 8192 <= c.get("context", 0) <= 65536:
            continue
        # (Lines with chunk_keys are a work-split sweep, not the fast set's call.)
        if c.get("kernel") in ("fast", "indexer_fast") and "byte_floor_us" in c and "chunk_keys" not in c:
            by.setdefault((path, c["layer"], c["context"], c["T"]), {})[c["kernel"]] = c
    rows = []
    for (path, layer, ctx, t), k in by.items():
        a = k.get("fast")
        if a is None:
            continue
        floor, time = a["byte_floor_us"], a["time_us"]
        if layer == "csa":
            i = k.get("indexer_fast")
            if i is None:
                continue
            floor, time = floor + i["byte_floor_us"], time + i["time_us"]
        label = f"{layer} {ctx // 1024}K T = {t} ({time:.2f} us, floor {floor:.2f})"
        rows.append(((layer, ctx, t), floor / time, label, path))
    return {"12 attention + indexer >= 70% HBM (8K-64K)": newest(rows)}


def standing(paths):
    """{must: {"threshold", "met", "by_gpu": {gpu: {"met", "cases"}}, "cases"}} over the files:
    each case {case, value, met, file, gpu}; "cases" lists every GPU's, and "met" needs the must
    met on every GPU with data (and some data)."""
    cases = load(paths)
    found = {}
    for part in (moe_rows(cases), dense_rows(cases), attn_rows(cases)):
        found.update(part)
    out = {}
    for must, threshold in MUSTS.items():
        by_gpu = {}
        for gpu, rows in sorted(found.get(must, {}).items()):
            listed = []
            for key, (value, label, path, cap) in sorted(rows.items(), key=lambda kv: str(kv[0])):
                row = {"case": label, "value": round(value, 3), "met": value >= threshold,
                       "file": path, "gpu": gpu}
                if cap is not None:
                    row["at_floor"] = round(cap, 3)
                    row["asks"] = round(threshold / cap, 3)
                listed.append(row)
            by_gpu[gpu] = {"met": bool(listed) and all(r["met"] for r in listed), "cases": listed}
        out[must] = {
            "threshold": threshold,
            "met": bool(by_gpu) and all(g["met"] for g in by_gpu.values()),
            "by_gpu": by_gpu,
            "cases": [c for g in by_gpu.values() for c in g["cases"]],
        }
    return out


def main(argv):
    paths = [a for a in argv if not a.startswith("--")]
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    result = standing(paths)
    if "--json" in argv:
        print(json.dumps(result, indent=1))
        return 0
    for must, r in result.items():
        verdict = "no data" if not r["cases"] else ("MET" if r["met"] else "not met")
        print(f"{must}: {verdict}")
        for gpu, g in r["by_gpu"].items():
            print(f"  {gpu}: {'MET' if g['met'] else 'not met'}")
            for row in g["cases"]:
                mark = "ok " if row["met"] else "-- "
                reach = ""
                if "at_floor" in row:
                    reach = (f"  (at its floor {row['at_floor']}x: beyond the roofline)" if row["asks"] > 1
                             else f"  (at its floor {row['at_floor']}x: asks {row['asks']:.0%} of the roofline)")
                print(f"    {mark}{row['value']:>8}  {row['case']}  [{row['file']}]{reach}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

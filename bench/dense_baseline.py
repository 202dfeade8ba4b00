#!/usr/bin/env python3
"""The ceilings and the PyTorch baselines for `dsv4 bench dense`, in the same run (PERF.md).

Reads the JSON lines `dsv4 bench dense` printed (one per projection, token count and path: the
gemv kernels, the cuBLASLt GEMM path, cuBLASLt alone), then on the same GPU:
  - measures the HBM ceiling, the FP8 ceiling (moe_baseline.py's functions) and the BF16 ceiling
    (an 8192^3 BF16 matmul);
  - times PyTorch on the same shapes, cycling over enough weight copies (>= 256 MB) that L2 holds
    none between calls, as the dsv4 bench does:
      * bf16: `x @ W.T` (or the grouped einsum of wo_a) on BF16 weights: what an engine without
        FP8 kernels runs;
      * fp8 (FP8 projections): `torch._scaled_mm` with DeepSeek's block scaling (1 x 128
        activation scales, 128 x 128 weight scales), i.e. cuBLASLt, the GEMM alone (the
        activations are quantized outside the timing);
  - `read_probe` lines (`--read-probe`): the byte floor and fraction of HBM only;
  - `dense_chain` lines (wo_a then wo_b, chained or as two calls): the FLOP floor (wo_a's BF16
    FLOPs on the BF16 ceiling plus wo_b's FP8 FLOPs on the FP8 one), the time over it, and the
    chain's speed-up over the two calls of the same T (with the same GEMM for wo_b);
  - adds per case the byte floor (weight bytes / HBM ceiling), the fraction of HBM bandwidth, the
    fraction of FP8 peak (FP8 projections) or of BF16 peak (BF16 ones) and the speed-up over each
    baseline (each baseline timed once per projection and T), and writes one JSON document.

usage: dense_baseline.py --cases cases.jsonl --out result.json [--commit SHA]
"""
import json

import torch

from moe_baseline import fp8_peak, hbm_bandwidth, parse_cases, timed, write_result


def bf16_peak():
    m = 8192
    a = torch.randn(m, m, device="cuda").to(torch.bfloat16)
    b = torch.randn(m, m, device="cuda").to(torch.bfloat16)
    t = timed(lambda: a @ b, 20)
    return 2 * m**3 / t


def copies_for(nbytes):
    return max(2, min(64, -(-(256 << 20) // nbytes)))


def bf16_baseline(c):
    n, k, g, t = c["N"], c["K"], c["groups"], c["T"]
    nbytes = g * n * k * 2
    ws = [(torch.randn(g, n, k, device="cuda") * 0.05).to(torch.bfloat16) for _ in range(copies_for(nbytes))]
    x = torch.randn(t, g, k, device="cuda").to(torch.bfloat16)
    if g == 1:
        fn = lambda: [x[:, 0] @ w[0].t() for w in ws]
    else:
        fn = lambda: [torch.einsum("tgk,gnk->tgn", x, w) for w in ws]
    return timed(fn, 7) / len(ws)


def fp8_baseline(c):
    """Seconds per call of torch._scaled_mm with block scales, or the reason it cannot run."""
    n, k, t = c["N"] * c["groups"], c["K"], c["T"]
    if c["groups"] != 1:
        return None, "grouped (BF16 einsum in the official model)"
    nbytes = n * k
    ws = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn) for _ in range(copies_for(nbytes))]
    sw = torch.ones(n // 128, k // 128, device="cuda")
    # cuBLASLt wants M a multiple of 16 with block scaling? pad the tokens to a multiple of 16.
    m = max(16, -(-t // 16) * 16)
    x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(m, k // 128, device="cuda")
    tried = []
    # Layouts torch versions accept for 1x128 (activations) and 128x128 (weights) scales.
    for sa_v, sw_v in [(sa.t().contiguous().t(), sw.t().contiguous().t()), (sa, sw), (sa.t().contiguous().t(), sw)]:
        try:
            f = lambda: [torch._scaled_mm(x, w.t(), scale_a=sa_v, scale_b=sw_v.t(), out_dtype=torch.bfloat16) for w in ws]
            f()
            return timed(f, 7) / len(ws), None
        except Exception as e:  # noqa: BLE001 - the reason is recorded
            tried.append(str(e).splitlines()[0][:200])
    return None, "; ".join(tried)


def main():
    args, cases = parse_cases()
    bw = hbm_bandwidth()
    peak = fp8_peak()
    peak16 = bf16_peak()
    memo = {}

    def once(kind, c, fn):
        key = (kind, c["projection"], c["T"])
        if key not in memo:
            memo[key] = fn(c)
        return memo[key]

    # A grouped launch's in-run baseline: the same group at the same T, one call per member.
    separate = {(c["group"], c["T"]): c["time_us"] for c in cases
                if c.get("bench") == "dense_group" and c["path"] == "separate"}
    # A chained pair's in-run baseline: the two calls at the same T, wo_b on the same GEMM.
    two_calls = {(c["T"], c["path"].replace("two_calls", "chained")): c["time_us"] for c in cases
                 if c.get("bench") == "dense_chain" and c["path"].startswith("two_calls")}
    for c in cases:
        ours = c["time_us"] * 1e-6
        if c.get("bench") == "dense_chain":
            floor = c["flops_bf16"] / peak16 + c["flops_fp8"] / peak
            c["floor_us"] = round(floor * 1e6, 2)
            c["floor_bound"] = "compute"
            c["time_over_floor"] = round(ours / floor, 3)
            if (c["T"], c["path"]) in two_calls:
                c["speedup_vs_two_calls"] = round(two_calls[(c["T"], c["path"])] / c["time_us"], 3)
            print(json.dumps(c), flush=True)
            continue
        if c.get("bench") == "read_probe":
            # The projection's bytes read by a kernel that only reads them: its size's ceiling.
            c["floor_us"] = round(c["bytes"] / bw * 1e6, 2)
            c["fraction_of_hbm"] = round(c["bytes"] / ours / bw, 3)
            print(json.dumps(c), flush=True)
            continue
        if c.get("bench") == "dense_group":
            if c["path"] != "separate" and (c["group"], c["T"]) in separate:
                c["speedup_vs_separate"] = round(separate[(c["group"], c["T"])] / c["time_us"], 2)
            # A grouped launch against its members one call each: the HBM floor of all their
            # bytes (PyTorch's per-member times are on the projections' own lines).
            c["floor_us"] = round(c["weight_bytes"] / bw * 1e6, 2)
            c["time_over_floor"] = round(ours / (c["weight_bytes"] / bw), 3)
            c["fraction_of_hbm"] = round(c["weight_bytes"] / ours / bw, 3)
            print(json.dumps(c), flush=True)
            continue
        floor_bytes = c["weight_bytes"] / bw
        floor_flops = c["flops"] / peak
        floor = max(floor_bytes, floor_flops)
        c["floor_us"] = round(floor * 1e6, 2)
        c["floor_bound"] = "memory" if floor_bytes >= floor_flops else "compute"
        c["time_over_floor"] = round(ours / floor, 3)
        c["fraction_of_hbm"] = round(c["weight_bytes"] / ours / bw, 3)
        c["fraction_of_fp8_peak"] = round(c["flops"] / ours / peak, 4)
        # A grouped projection (wo_a) is a BF16 einsum in the official model whatever its
        # weight's storage: the BF16 tensor core is its ceiling.
        if c["format"] == "bf16" or c["groups"] != 1:
            c["fraction_of_bf16_peak"] = round(c["flops"] / ours / peak16, 4)
        tb = once("bf16", c, bf16_baseline)
        c["torch_bf16_us"] = round(tb * 1e6, 2)
        c["speedup_vs_torch_bf16"] = round(tb / ours, 2)
        if c["format"] == "fp8":
            tf, why = once("fp8", c, fp8_baseline)
            if tf is None:
                c["torch_fp8_blockwise"] = f"not run: {why}"
            else:
                c["torch_fp8_blockwise_us"] = round(tf * 1e6, 2)
                c["speedup_vs_torch_fp8_blockwise"] = round(tf / ours, 2)
        print(json.dumps(c), flush=True)
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 "dsv4 bench dense > cases.jsonl; python3 bench/dense_baseline.py --cases cases.jsonl --out OUT",
                 {"hbm_bytes_per_s": bw, "fp8_flop_per_s": peak, "bf16_flop_per_s": peak16}, cases)


if __name__ == "__main__":
    main()

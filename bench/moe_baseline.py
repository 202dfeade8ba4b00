#!/usr/bin/env python3
"""The ceilings and the PyTorch baseline for `dsv4 bench moe`, in the same run (PERF.md).

Reads the JSON lines `dsv4 bench moe --ids-dir DIR` printed (one per case) and the expert ids it
wrote to DIR for each case, then on the same GPU:
  - measures the HBM ceiling (device-to-device copy of 4 GiB, bytes read + written) and the FP8
    ceiling (torch._scaled_mm 8192^3, per-tensor scales);
  - times the straightforward PyTorch MoE on the SAME routing (the expert ids dsv4 chose for
    the case's first input batch), on weights drawn from the same distribution (random FP4
    codes times per-32 scales 2^-9..2^-5, dequantized to BF16; the shared expert BF16 too):
    f32 router logits -> sqrtsoftplus -> renormalised weights x 1.5, tokens sorted by expert,
    torch._grouped_mm for gate/up and down, clamped SwiGLU, index_add combine, shared expert;
  - writes one JSON document with every case, its floor, and the ratios.

usage: moe_baseline.py --cases cases.jsonl --ids-dir DIR --out result.json [--commit SHA]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def timed(fn, reps, warmup=3):
    """Median seconds of `reps` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def parse_cases(*required):
    """The arguments every baseline script takes (--cases, --out, --commit, and the `required`
    extra ones) and the cases: the JSON lines of the dsv4 bench's output."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    for name in required:
        ap.add_argument(name, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default=os.environ.get("DSV4_COMMIT", "unknown"))
    args = ap.parse_args()
    cases = [json.loads(l) for l in open(args.cases) if l.startswith("{")]
    # A bench run with `--defines` timed kernel variants, not the kernels its results would
    # name: no baseline file for it.
    variant = [c["defines"] for c in cases if c.get("bench") == "defines"]
    if variant:
        sys.exit(f"{args.cases}: timed with --defines {variant[0]}; the baselines are for the default kernels")
    return args, cases


def write_result(path, commit, command, ceilings, cases):
    """The JSON document a baseline script writes (bench/results/): where, what, the cases."""
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": commit,
        "command": command,
        "ceilings": ceilings,
        "cases": cases,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def hbm_bandwidth():
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * n / t


def fp8_peak():
    m = 8192
    a = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    t = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    return 2 * m**3 / t


def fp4_dequantized(e, rows, cols, gen):
    """[e, rows, cols] BF16: random FP4 values times per-32 scales 2^-9 .. 2^-5."""
    lut = torch.tensor(FP4_VALUES, device="cuda", dtype=torch.float32)
    out = torch.empty(e, rows, cols, dtype=torch.bfloat16, device="cuda")
    for x in range(e):
        codes = torch.randint(0, 16, (rows, cols), device="cuda", generator=gen)
        exps = torch.randint(-9, -4, (rows, cols // 32, 1), device="cuda", generator=gen).float()
        v = lut[codes].view(rows, cols // 32, 32) * torch.exp2(exps)
        out[x] = v.view(rows, cols).to(torch.bfloat16)
    return out


class TorchMoe:
    def __init__(self, d, i, e, k):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1234)
        self.d, self.i, self.e, self.k = d, i, e, k
        # Grouped-mm operands [E, K, N]: K-major views of [E, N, K] storage.
        self.w13 = fp4_dequantized(e, 2 * i, d, gen).transpose(1, 2)  # [E, D, 2I]
        self.w2 = fp4_dequantized(e, d, i, gen).transpose(1, 2)  # [E, I, D]
        self.s13 = fp4_dequantized(1, 2 * i, d, gen)[0].t()  # [D, 2I]
        self.s2 = fp4_dequantized(1, d, i, gen)[0].t()  # [I, D]
        self.gate = ((torch.rand(e, d, device="cuda", generator=gen) - 0.5) * 0.1).to(torch.bfloat16)

    def __call__(self, x, ids):
        d, i, k = self.d, self.i, self.k
        logits = x.float() @ self.gate.float().t()
        scores = torch.sqrt(torch.nn.functional.softplus(logits))
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * 1.5
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=self.e), 0).to(torch.int32)
        xs = x[tok]
        h = torch._grouped_mm(xs, self.w13, offs=offs)
        g, u = h[:, :i].float().clamp(max=10.0), h[:, i:].float().clamp(-10.0, 10.0)
        a = (torch.nn.functional.silu(g) * u * w.flatten()[order, None]).to(torch.bfloat16)
        y = torch._grouped_mm(a, self.w2, offs=offs)
        out = torch.zeros(x.shape[0], d, device="cuda", dtype=torch.float32)
        out.index_add_(0, tok, y.float())
        hs = x @ self.s13
        gs, us = hs[:, :i].float().clamp(max=10.0), hs[:, i:].float().clamp(-10.0, 10.0)
        out += (torch.nn.functional.silu(gs) * us).to(torch.bfloat16) @ self.s2
        return out.to(torch.bfloat16)


def main():
    args, cases = parse_cases("--ids-dir")
    bw = hbm_bandwidth()
    peak = fp8_peak()
    # The layer's cases; the router chain's lines (`moe_norm_route`) go into the file as measured.
    layers = [c for c in cases if c.get("bench") == "moe"]
    c0 = layers[0]
    tm = TorchMoe(c0["hidden"], c0["moe_inter"], c0["experts"], c0["top_k"])
    for c in layers:
        b, k = c["B"], c["top_k"]
        path = os.path.join(args.ids_dir, f"moe_ids_B{b}_{c['routing']}.bin")
        ids = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.int32).view(b, k)
        ids = ids.to(device="cuda", dtype=torch.int64)
        x = (torch.rand(b, c["hidden"], device="cuda") * 4 - 2).to(torch.bfloat16)
        reps = 20 if b <= 1024 else 10
        t = timed(lambda: tm(x, ids), reps)
        ours = c["time_us"] * 1e-6
        floor_bytes = c["touched_bytes"] / bw
        floor_flops = c["flops"] / peak
        c["torch_grouped_mm_us"] = round(t * 1e6, 2)
        c["speedup_vs_torch"] = round(t / ours, 2)
        c["floor_us"] = round(max(floor_bytes, floor_flops) * 1e6, 2)
        c["floor_bound"] = "memory" if floor_bytes >= floor_flops else "compute"
        c["time_over_floor"] = round(ours / max(floor_bytes, floor_flops), 3)
        c["fraction_of_hbm"] = round(c["touched_bytes"] / ours / bw, 3)
        c["fraction_of_fp8_peak"] = round(c["flops"] / ours / peak, 4)
        print(json.dumps(c), flush=True)
    write_result(args.out, args.commit,
                 "dsv4 bench moe --ids-dir DIR > cases.jsonl; python3 bench/moe_baseline.py --cases cases.jsonl --ids-dir DIR --out OUT",
                 {"hbm_bytes_per_s": bw, "fp8_flop_per_s": peak}, cases)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The HBM ceiling and the PyTorch baseline for `dsv4 bench attn`, in the same run (PERF.md).

Reads the JSON lines `dsv4 bench attn` printed (one per layer kind, context, batch and kernel:
the fast attention and, up to 8 tokens, the f64 reference kernel; on CSA layers the same for the
indexer), then on the same GPU:
  - measures the HBM ceiling (moe_baseline.py's function);
  - times PyTorch on each (layer, context, batch): what an engine without a sparse FP8 kernel
    runs, on a BF16 KV cache (1024 bytes a row against our 584): gather each token's rows with
    index_select, `q @ K^T * scale`, the sink as an extra logit column, softmax in f32, `P @ V`
    (V = K, MLA), BF16 out; for the indexer lines, a BF16 key cache (256 bytes a key against our
    68): the visible keys gathered, per-head dots, ReLU, the weighted sum over heads, torch.topk.
    Each call gathers random rows of a cache of at least 256 MB, so L2 holds none of them
    between calls, as the dsv4 bench cycles its state copies;
  - measures the BF16 and FP8 tensor-core ceilings (dense_baseline.py's 8192^3 BF16 matmul,
    moe_baseline.py's FP8 one): the attention's products run on BF16 mma, the indexer's on FP8
    wgmma (its FP4 keys are exact in e4m3);
  - adds per case the byte floor (the bytes a call must move: the KV rows gathered in our format
    plus q and o in BF16, over the HBM ceiling), the FLOP floor (the tensor-core products over the
    ceiling of the precision they run in: attention 4 T H keys hd at BF16, S = Q K^T and O = P V
    with V = K; indexer 2 T H keys d at FP8),
    the floor as the larger of the two (PERF.md: "the larger is the floor") and which it is, the
    fraction of HBM bandwidth (the must's measure), the fraction of the floor, the speed-up over
    PyTorch and over the reference kernel (and, for the indexer's other variants and work splits,
    over the fast set's indexer call of the same case), and writes one JSON document.

usage: attn_baseline.py --cases cases.jsonl --out result.json [--commit SHA]
"""
import json

import torch

from dense_baseline import bf16_peak
from moe_baseline import fp8_peak, hbm_bandwidth, parse_cases, timed, write_result


def torch_attention(c):
    t, h, d, nk = c["T"], c["heads"], c["head_dim"], c["keys_per_token"]
    rows = max(t * nk, (256 << 20) // (d * 2))
    cache = (torch.randn(rows, d, device="cuda") * 0.1).to(torch.bfloat16)
    q = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    sink = torch.randn(h, device="cuda")
    copies = 8
    idx = [torch.randint(0, rows, (t * nk,), device="cuda") for _ in range(copies)]
    scale = d ** -0.5

    def call(i):
        k = cache.index_select(0, i).view(t, nk, d)
        s = torch.einsum("thd,tkd->thk", q, k).float() * scale
        s = torch.cat([s, sink.view(1, h, 1).expand(t, h, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :nk].to(torch.bfloat16)
        return torch.einsum("thk,tkd->thd", p, k)

    return timed(lambda: [call(i) for i in idx], 7) / copies


def torch_indexer(c):
    """The lightning indexer on a BF16 key cache: gather the visible keys, per-head dots, ReLU,
    weighted sum over heads, torch.topk."""
    t, h, d, nk, k = c["T"], c["heads"], c["head_dim"], c["keys_per_token"], c["topk"]
    rows = max(t * nk, (256 << 20) // (d * 2))
    cache = (torch.randn(rows, d, device="cuda") * 0.1).to(torch.bfloat16)
    q = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    w = torch.randn(t, h, device="cuda")
    copies = 4
    idx = [torch.randint(0, rows, (t * nk,), device="cuda") for _ in range(copies)]

    def call(i):
        keys = cache.index_select(0, i).view(t, nk, d)
        s = torch.relu(torch.einsum("thd,tkd->thk", q, keys).float())
        scores = (s * w.view(t, h, 1)).sum(dim=1)
        return torch.topk(scores, min(k, nk), dim=-1).indices

    return timed(lambda: [call(i) for i in idx], 5) / copies


def family(c):
    return "indexer" if c["kernel"].startswith("indexer") else "attention"


def tensor_flops(c):
    """The products a call must do on tensor cores: attention S = Q K^T and O = P V over every
    head and key (V is K: MLA), the indexer's per-head dots."""
    per_key = 2 if family(c) == "indexer" else 4
    return per_key * c["T"] * c["heads"] * c["keys_per_token"] * c["head_dim"]


def add_floors(c, bw, peak16, peak8):
    """Byte floor, FLOP floor (the indexer's products at the FP8 ceiling, the attention's at
    BF16), the floor (the larger) and the ratios of a case's time to them."""
    ours = c["time_us"] * 1e-6
    byte_floor = c["io_bytes"] / bw
    flop_floor = tensor_flops(c) / (peak8 if family(c) == "indexer" else peak16)
    floor = max(byte_floor, flop_floor)
    c["byte_floor_us"] = round(byte_floor * 1e6, 2)
    c["flop_floor_us"] = round(flop_floor * 1e6, 2)
    c["floor_us"] = round(floor * 1e6, 2)
    c["bound_by"] = "bytes" if byte_floor >= flop_floor else "flops"
    c["time_over_floor"] = round(ours / floor, 2)
    c["fraction_of_hbm"] = round(byte_floor / ours, 3)
    c["fraction_of_floor"] = round(floor / ours, 3)


def main():
    args, cases = parse_cases()
    bw = hbm_bandwidth()
    peak16 = bf16_peak()
    peak8 = fp8_peak()
    reference = {(family(c), c["layer"], c["context"], c["T"]): c["time_us"]
                 for c in cases if c["kernel"] in ("reference", "indexer_reference")}
    # The fast set's indexer call (not a work-split sweep line) of each case: the other indexer
    # variants and splits get their speed-up over it.
    fast_indexer = {(c["layer"], c["context"], c["T"]): c["time_us"]
                    for c in cases if c["kernel"] == "indexer_fast" and "chunk_keys" not in c}
    memo = {}
    for c in cases:
        ours = c["time_us"] * 1e-6
        add_floors(c, bw, peak16, peak8)
        key = (family(c), c["layer"], c["context"], c["T"])
        if key not in memo:
            memo[key] = torch_indexer(c) if family(c) == "indexer" else torch_attention(c)
            torch.cuda.empty_cache()
        c["torch_bf16_us"] = round(memo[key] * 1e6, 2)
        c["speedup_vs_torch_bf16"] = round(memo[key] / ours, 2)
        # The fast indexer's kernels: the fast set's (`indexer_fast*`), the streamed one and the
        # streamed one with its top-k in the launch.
        fast_kind = c["kernel"].startswith(("indexer_fast", "indexer_stream", "indexer_fused"))
        if (c["kernel"] == "fast" or fast_kind) and key in reference:
            c["speedup_vs_reference_kernel"] = round(reference[key] * 1e-6 / ours, 1)
        own = fast_indexer.get((c["layer"], c["context"], c["T"]))
        variant = c["kernel"] != "indexer_fast" or "chunk_keys" in c
        if fast_kind and variant and own is not None:
            c["speedup_vs_indexer_fast"] = round(own * 1e-6 / ours, 3)
        print(json.dumps(c), flush=True)
    write_result(args.out, args.commit,
                 "dsv4 bench attn > cases.jsonl; python3 bench/attn_baseline.py --cases cases.jsonl --out OUT",
                 {"hbm_bytes_per_s": bw, "bf16_flop_per_s": peak16, "fp8_flop_per_s": peak8}, cases)


if __name__ == "__main__":
    main()

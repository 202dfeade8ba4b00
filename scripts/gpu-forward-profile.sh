#!/usr/bin/env bash
# Per-kernel GPU time of every forward of a short run — a prefill of TOKENS tokens, then one decode
# step — under ncu (kernels serialized: durations, not overlap), on the GPU machine with the staged
# CLI. Writes $OUT/forward.csv.xz (every kernel of the run) and $OUT/forward.txt: for each forward
# (split at the batch check kernel that starts one) its kernels summed by name, largest first.
# Run it before tuning any one kernel: a 4096-token prefill's profile showed two reference kernels
# bound by their launch shape, not their arithmetic (BENCHMARKS.md, issue 12 eleventh part).
# usage: scripts/gpu-forward-profile.sh CONFIG [TOKENS] [BATCH]     (defaults 4096, 1)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cfg=$1
tokens=${2:-4096}
batch=${3:-1}
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --metrics gpu__time_duration.sum --csv --print-units base -c 8000 \
  "$cli" bench --config "$cfg" --device cuda --tokens "$tokens" --decode-steps 1 --decode-batch "$batch" --graph 0 \
  >"$OUT/forward.csv" 2>"$OUT/forward.log"
echo "ncu rc=$?"
python3 - "$OUT/forward.csv" "$OUT/forward.txt" <<'PY'
import csv, sys, collections
# Only ncu's rows (the bench's JSON line shares the file): the header, then numeric IDs.
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and (r[0] == "ID" or r[0].isdigit())]
hdr = next(r for r in rows if r[0] == "ID"); rows = [r for r in rows if r[0] != "ID"]
ni, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
ks = [(r[ni].split("(")[0], float(r[vi].replace(",", ""))) for r in rows]
starts = [i for i, (n, _) in enumerate(ks) if n.startswith("batch_check")] or [0]
with open(sys.argv[2], "w") as f:
    for j, s in enumerate(starts):
        seg = ks[s:starts[j + 1] if j + 1 < len(starts) else len(ks)]
        tot = collections.defaultdict(lambda: [0, 0.0])
        for n, ns in seg:
            tot[n][0] += 1
            tot[n][1] += ns
        all_ns = sum(v[1] for v in tot.values())
        f.write(f"== forward {j}: {len(seg)} kernels, sum {all_ns / 1e3:.1f} us\n")
        for n, (c, ns) in sorted(tot.items(), key=lambda x: -x[1][1]):
            f.write(f"{ns / 1e3:10.1f} us {100 * ns / all_ns:5.1f}% {c:5d}x {n}\n")
print(open(sys.argv[2]).read()[:6000])
PY
xz -9f "$OUT/forward.csv"

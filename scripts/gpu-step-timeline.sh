#!/usr/bin/env bash
# Per-kernel GPU time of one eager decode step (ncu, kernels serialized: durations, not overlap),
# on the GPU machine with the staged CLI. Writes $OUT/timeline.csv (every kernel of the run) and
# $OUT/timeline.txt (the last step's kernels summed by name, largest first).
# usage: scripts/gpu-step-timeline.sh CONFIG [BATCH]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cfg=$1
batch=${2:-1}
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
# Two decode steps after a short prefill: the last step's kernels are the timeline.
"$ncu" --metrics gpu__time_duration.sum --csv --print-units base -c 4000 \
  "$cli" bench --config "$cfg" --device cuda --tokens "$batch" --decode-steps 2 --decode-batch "$batch" --graph 0 \
  >"$OUT/timeline.csv" 2>"$OUT/timeline.log"
echo "ncu rc=$?"
python3 - "$OUT/timeline.csv" "$OUT/timeline.txt" <<'PY'
import csv, sys, collections
# Only ncu's rows (the bench's JSON line shares the file): the header, then numeric IDs.
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and (r[0] == "ID" or r[0].isdigit())]
hdr = next(r for r in rows if r[0] == "ID"); rows = [r for r in rows if r[0] != "ID"]
ki, ni, vi = hdr.index("ID"), hdr.index("Kernel Name"), hdr.index("Metric Value")
ks = [(int(r[ki]), r[ni], float(r[vi].replace(",", ""))) for r in rows]
# The last step: kernels after the last launch of the batch check kernel that starts a forward.
starts = [i for i, (_, n, _) in enumerate(ks) if n.startswith("batch_check")]
step = ks[starts[-1]:] if starts else ks
tot = collections.defaultdict(lambda: [0, 0.0])
for _, n, ns in step:
    tot[n][0] += 1; tot[n][1] += ns
with open(sys.argv[2], "w") as f:
    all_ns = sum(v[1] for v in tot.values())
    f.write(f"kernels {len(step)}, sum {all_ns/1e3:.1f} us\n")
    for n, (c, ns) in sorted(tot.items(), key=lambda x: -x[1][1]):
        f.write(f"{ns/1e3:10.1f} us {100*ns/all_ns:5.1f}% {c:5d}x {n}\n")
print(open(sys.argv[2]).read()[:3000])
PY

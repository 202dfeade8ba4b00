#!/usr/bin/env bash
# Per-kernel GPU time of an eager run (ncu, kernels serialized: durations, not overlap), on the GPU
# machine with the staged CLI: a prefill of TOKENS tokens (default BATCH, a short one), then two
# decode steps of BATCH. Writes $OUT/timeline.csv.xz (every kernel of the run), $OUT/timeline.txt
# (the last decode step's kernels summed by name, largest first) and $OUT/forwards.txt (the same for
# every forward: the prefill, then each step). Run it with a long prefill before tuning any one
# prefill kernel: a 4096-token prefill's profile showed two reference kernels bound by their launch
# shape, not their arithmetic (BENCHMARKS.md, issue 12 eleventh part).
# usage: scripts/gpu-step-timeline.sh CONFIG [BATCH] [TOKENS]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
cfg=$1
batch=${2:-1}
tokens=${3:-$batch}
cli=${DSV4_CLI:-target/gpu-bin/dsv4}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --metrics gpu__time_duration.sum --csv --print-units base -c 8000 \
  "$cli" bench --config "$cfg" --device cuda --tokens "$tokens" --decode-steps 2 --decode-batch "$batch" --graph 0 \
  >"$OUT/timeline.csv" 2>"$OUT/timeline.log"
echo "ncu rc=$?"
python3 - "$OUT/timeline.csv" "$OUT/timeline.txt" "$OUT/forwards.txt" <<'PY'
import csv, sys, collections
# Only ncu's rows (the bench's JSON line shares the file): the header, then numeric IDs.
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10 and (r[0] == "ID" or r[0].isdigit())]
hdr = next(r for r in rows if r[0] == "ID"); rows = [r for r in rows if r[0] != "ID"]
ni, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
ks = [(r[ni].split("(")[0], float(r[vi].replace(",", ""))) for r in rows]

def summary(seg):
    tot = collections.defaultdict(lambda: [0, 0.0])
    for n, ns in seg:
        tot[n][0] += 1; tot[n][1] += ns
    all_ns = sum(v[1] for v in tot.values())
    lines = [f"kernels {len(seg)}, sum {all_ns/1e3:.1f} us\n"]
    for n, (c, ns) in sorted(tot.items(), key=lambda x: -x[1][1]):
        lines.append(f"{ns/1e3:10.1f} us {100*ns/all_ns:5.1f}% {c:5d}x {n}\n")
    return "".join(lines)

# A forward starts with the batch check kernel; the last one is the timeline's step.
starts = [i for i, (n, _) in enumerate(ks) if n.startswith("batch_check")] or [0]
segs = [ks[s:e] for s, e in zip(starts, starts[1:] + [len(ks)])]
open(sys.argv[2], "w").write(summary(segs[-1]))
with open(sys.argv[3], "w") as f:
    for j, seg in enumerate(segs):
        f.write(f"== forward {j}: " + summary(seg))
print(open(sys.argv[3]).read()[:6000])
PY
xz -9f "$OUT/timeline.csv"

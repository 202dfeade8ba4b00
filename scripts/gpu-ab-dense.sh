#!/usr/bin/env bash
# `dsv4 bench dense` of several builds in ONE device call, alternating them ROUNDS times (default 2)
# so their numbers share the machine's state; then each case's best time per build, side by side.
# Builds nothing. Writes $OUT/ab_LABEL_ROUND.txt (the bench's lines) and $OUT/ab_summary.txt.
# usage: scripts/gpu-ab-dense.sh LABEL=CLI [LABEL=CLI ...]
#   e.g. ARGS="--tokens 1,2,8,16" scripts/gpu-ab-dense.sh main=target/gpu-prev/main new=target/gpu-bin/dsv4
# ARGS: the bench's arguments (default --tokens 1,2,8,16). Labels must not contain '_'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
args=${ARGS:---tokens 1,2,8,16}
rounds=${ROUNDS:-2}
[ $# -ge 1 ] || { echo "usage: $0 LABEL=CLI [LABEL=CLI ...]" >&2; exit 2; }
for r in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    label=${spec%%=*}
    cli=${spec#*=}
    # shellcheck disable=SC2086 # args is a word list
    timeout 300 "$cli" bench dense $args >"$OUT/ab_${label}_$r.txt" 2>&1
    echo "bench dense $label round $r: rc=$?"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/ab_summary.txt"
import json, glob, os, sys, collections
out = sys.argv[1]
d = collections.defaultdict(list)
for f in sorted(glob.glob(out + "/ab_*_*.txt")):
    label = os.path.basename(f).split("_")[1]
    for line in open(f):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if "time_us" in j:
            name = j.get("projection") or j.get("group") or j.get("bench")
            d[(name, j.get("T"), j.get("path"), j.get("slices"), label)].append(j["time_us"])
labels = sorted({k[-1] for k in d})
cases = sorted({k[:-1] for k in d}, key=lambda k: tuple(str(x) for x in k))
print("case (best time_us of the rounds)", *labels)
for k in cases:
    best = [f"{min(d[k + (l,)]):9.2f}" if d[k + (l,)] else "        -" for l in labels]
    print(f"{k[0]:26s} T={k[1]!s:4s} {k[2]!s:18s} slices={k[3]!s:2s}", *best)
PY

#!/usr/bin/env bash
# `dsv4 bench KIND` (dense, moe, attn) of several builds in ONE device call, alternating them ROUNDS
# times (default 2) so their numbers share the machine's state; then each case's best time per build,
# side by side. Builds nothing. Writes $OUT/ab_LABEL_ROUND.txt (the bench's lines) and $OUT/ab_summary.txt.
# usage: scripts/gpu-ab.sh KIND LABEL=CLI[@DEFINES] [LABEL=CLI[@DEFINES] ...]
#   e.g. ARGS="--tokens 1,2,8,16" scripts/gpu-ab.sh dense main=target/gpu-prev/main new=target/gpu-bin/dsv4
#        scripts/gpu-ab.sh attn main=target/gpu-bin/dsv4 unshared=target/gpu-bin/dsv4@FA_SOFTMAX_SPLIT=0
#   (@DEFINES: the CLI's `--defines`, comma-separated: a kernel's #if variant from the same build)
#        ARGS="--batches 4096,16384 --routing uniform --path prefill" scripts/gpu-ab.sh moe main=... new=...
# ARGS: the bench's arguments (default none: the bench's own cases). Labels must not contain '_'.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
kind=${1:?usage: $0 KIND LABEL=CLI [LABEL=CLI ...]}
shift
args=${ARGS:-}
rounds=${ROUNDS:-2}
[ $# -ge 1 ] || { echo "usage: $0 KIND LABEL=CLI [LABEL=CLI ...]" >&2; exit 2; }
for r in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    label=${spec%%=*}
    cli=${spec#*=}
    defs=()
    if [[ $cli == *@* ]]; then
      defs=(--defines "${cli#*@}")
      cli=${cli%%@*}
    fi
    # shellcheck disable=SC2086 # args is a word list
    timeout 300 "$cli" bench "$kind" $args "${defs[@]}" >"$OUT/ab_${label}_$r.txt" 2>&1
    echo "bench $kind $label round $r: rc=$?"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/ab_summary.txt"
import json, glob, os, sys, collections
out = sys.argv[1]
# The fields that name a case (whichever a bench writes); everything else is a measurement.
ids = ["projection", "group", "layer", "kernel", "context", "T", "B", "routing", "path", "router", "slices",
       "splits", "chunk_keys", "chunks_per_block", "topk_cluster", "cluster"]
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
            case = " ".join(f"{k}={j[k]}" for k in ids if k in j)
            d[(case, label)].append(j["time_us"])
labels = sorted({k[1] for k in d})
cases = sorted({k[0] for k in d})
print("case (best time_us of the rounds)", *labels)
for c in cases:
    best = [f"{min(d[(c, l)]):9.2f}" if d[(c, l)] else "        -" for l in labels]
    print(f"{c:48s}", *best)
PY

#!/usr/bin/env bash
# The whole forward step of several builds in ONE device call (so their numbers share the
# machine's state), on the GPU machine. Builds nothing.
# usage: scripts/gpu-step-compare.sh LABEL=CLI [LABEL=CLI ...]
#   e.g. scripts/gpu-step-compare.sh before=target/gpu-prev/dsv4 after=target/gpu-bin/dsv4
# Each CLI runs `dsv4 bench --config $STEP_CONFIG --device cuda --tokens 4096 --decode-steps 16
# --decode-batch 1,8 --graph 1 --prefill-repeats 3` (STEP_ARGS replaces everything after the
# config). Compare prefills by `prefill_ms_repeats_median`: an engine's first prefill
# (`prefill_ms`) also pays one-time costs and moves by several ms from run to run. Writes
# $OUT/step-LABEL.jsonl and $OUT/step.json ({date, gpu, command, runs: {LABEL: [lines]}}, the
# file to commit as bench/results/<date>-step-<what>.json once its "note" says what each label
# is).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/gpu-unpack.sh  # the carried pack's binaries (scripts/gpu-unpack.sh)
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
config=${STEP_CONFIG:-configs/flash-shaped-4-layers.json}
args=${STEP_ARGS:---device cuda --tokens 4096 --decode-steps 16 --decode-batch 1,8 --graph 1 --prefill-repeats 3}
[ $# -ge 1 ] || { echo "usage: $0 LABEL=CLI [LABEL=CLI ...]" >&2; exit 2; }
rc=0
labels=()
for spec in "$@"; do
  label=${spec%%=*}
  cli=${spec#*=}
  # shellcheck disable=SC2086 # args is a word list
  "$cli" bench --config "$config" $args >"$OUT/step-$label.jsonl" 2>"$OUT/step-$label.log"
  r=$?
  echo "step $label ($cli): rc=$r"
  [ $r -eq 0 ] || rc=$r
  labels+=("$label")
done
python3 - "$OUT" "dsv4 bench --config $config $args" "${labels[@]}" <<'PY'
import json, subprocess, sys, time
out, command, labels = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()[0]
except Exception:  # noqa: BLE001 - the name is informative only
    gpu = "unknown"
runs = {l: [json.loads(x) for x in open(f"{out}/step-{l}.jsonl") if x.startswith("{")] for l in labels}
doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "command": command, "runs": runs}
json.dump(doc, open(f"{out}/step.json", "w"), indent=1)
for l, rs in runs.items():
    for r in rs:
        print(f"{l}: decode batch {r.get('decode_batch')}: graph {r.get('graph_decode_ms_median')} ms, "
              f"prefill {r.get('prefill_seqs')} x {r.get('prefill_tokens') // max(r.get('prefill_seqs') or 1, 1)}: "
              f"{r.get('prefill_ms_repeats_median', '-')} ms repeated (first {r.get('prefill_ms')} ms)")
PY
exit $rc

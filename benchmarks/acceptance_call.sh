#!/usr/bin/env bash
# One device call of issue 32's measurements (benchmarks/experiments/beyond_flags.py), run from the
# repository root on a GPU machine, several steps in a row, each merged into the last's results:
#
#   OUT=/path/to/out bash benchmarks/acceptance_call.sh 'STEP:WORKLOADS[+STEP:WORKLOADS...]'
#
# steps (each `beyond_flags --acceptance --merge` unless said):
#   profile       --profile-missed: the plan of each missed row without a profile, traced (no runs)
#   first         rose_plan: `rose-jax train --optimize --plan-only` into the plan cache (BUDGET s)
#   cached        rose_cached: `rose-jax train --optimize` on the plan cache (PROF=--profile traces it)
#   peer_flags    Brax's trainer with XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT
#   peer_default  Brax's trainer as shipped
#   flags_only    `rose-jax train` (its option trial only)
#   inproc        no --acceptance: the in-process variants $VARIANTS, equality of $CHECK, --profile
# env: OUT (required: results under $OUT/bf, the log $OUT/log.txt, the plan cache $OUT/plans.json),
#      BUDGET (first; default 300), RT (per-run timeout s), PROF, VARIANTS, CHECK, PLANS (plan cache
#      dir; default runs/plans). Wheels carried in .whl/ (../shared/device/fetch_wheels.sh) are
#      installed first (benchmarks/device_prelude.sh). The merged results start from BASE (default
#      benchmarks/results/beyond_flags/results.json): to chain calls on one warm machine, so that a
#      later call's rows fold in the earlier calls' runs (fold_all), copy each call's $OUT/bf/results.json
#      to runs/bf/results.json here, carry runs/bf, and set BASE=runs/bf/results.json.
set -uo pipefail
SPEC=${1:?usage: OUT=DIR bash benchmarks/acceptance_call.sh 'STEP:WORKLOADS[+STEP:WORKLOADS...]'}
: "${OUT:?set OUT to the output folder}"
IFS='+' read -ra STEPS <<< "$SPEC"
for S in "${STEPS[@]}"; do
  case "${S%%:*}" in
    profile|first|cached|peer_flags|peer_default|flags_only|inproc) ;;
    *) echo "unknown step '${S%%:*}' (profile, first, cached, peer_flags, peer_default, flags_only, inproc)" >&2
       exit 2 ;;
  esac
  [ "${S#*:}" != "$S" ] && [ -n "${S#*:}" ] || { echo "step '$S' names no workloads (STEP:WORKLOADS)" >&2; exit 2; }
done
BASE=${BASE:-benchmarks/results/beyond_flags/results.json}
[ -f "$BASE" ] || { echo "BASE $BASE: no such results file" >&2; exit 2; }
if compgen -G ".whl/*.whl" >/dev/null; then
  source benchmarks/device_prelude.sh
else
  export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
PLANS=${PLANS:-$PWD/runs/plans}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPU: ${GPU:-none}  spec=$SPEC  $(date -u +%H:%M:%S)" | tee -a "$OUT/log.txt"
mkdir -p "$OUT/bf" "$PLANS"
cp "$BASE" "$OUT/bf/results.json"
for S in "${STEPS[@]}"; do
  STEP=${S%%:*}; WL=${S#*:}
  BF=(python -m benchmarks.experiments.beyond_flags --merge --out "$OUT/bf" --workloads "$WL")
  ACC=("${BF[@]}" --acceptance --plan-cache "$PLANS")
  case "$STEP" in
    profile)      CMD=("${ACC[@]}" --profile-missed) ;;
    first)        CMD=("${ACC[@]}" --peer-variants '' --rose-variants rose_plan
                       "--optimize-argv=--optimize-budget ${BUDGET:-300} --mps-client" --run-timeout-s "${RT:-560}") ;;
    cached)       CMD=("${ACC[@]}" --peer-variants '' --rose-variants rose_cached
                       "--cached-argv=--optimize-budget none --mps-client" --run-timeout-s "${RT:-480}" ${PROF:+$PROF}) ;;
    peer_flags)   CMD=("${ACC[@]}" --peer-variants peer_flags --rose-variants '' --run-timeout-s "${RT:-560}") ;;
    peer_default) CMD=("${ACC[@]}" --peer-variants peer_default --rose-variants '' --run-timeout-s "${RT:-565}") ;;
    flags_only)   CMD=("${ACC[@]}" --peer-variants '' --rose-variants flags_only --run-timeout-s "${RT:-480}") ;;
    inproc)       CMD=("${BF[@]}" --variants "${VARIANTS:?set VARIANTS}" --check-equal "${CHECK:-}" --profile) ;;
    *) exit 2 ;;  # checked above
  esac
  echo "CMD $(date -u +%H:%M:%S): ${CMD[*]}" | tee -a "$OUT/log.txt"
  # progress bars dropped; line-buffered, so a call cut by its limit keeps its log
  "${CMD[@]}" 2>&1 | grep --line-buffered -v -E '^\s*$|it/s\]|s/it\]' >> "$OUT/log.txt"
  echo "rc=${PIPESTATUS[0]} $(date -u +%H:%M:%S)" | tee -a "$OUT/log.txt"
  cp "$PLANS/plans.json" "$OUT/plans.json" 2>/dev/null
done
tail -40 "$OUT/log.txt"

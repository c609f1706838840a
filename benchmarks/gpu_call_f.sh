#!/usr/bin/env bash
# Device call F: the optimizer on whole training epochs with evaluation (issue 6), as an MPS client.
# One env count per call (about 7.5 min each on the H200):  bash benchmarks/gpu_call_f.sh 2048
set -uo pipefail
N=${1:-2048}
source benchmarks/device_prelude.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
OUTDIR=benchmarks/results/optimize_epoch$([ "$N" = 2048 ] || echo "_$N")
timeout "${F_TIMEOUT:-575}" python3 benchmarks/optimize_gpu.py --unit epoch --mps-client --iters 3 --repeats 1 --equality-iters 1 \
  --budget-s 330 --num-envs "$N" --out "$OUTDIR" 2>&1 | grep -v -iE "warn|warp" > $OUT/optimize_epoch_$N.log
tail -32 $OUT/optimize_epoch_$N.log
tar czf $OUT/results_f_$N.tgz "$OUTDIR" 2>/dev/null; ls -la $OUT

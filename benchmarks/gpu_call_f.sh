#!/usr/bin/env bash
# Device call F: the optimizer on whole training epochs with evaluation (issue 6), as an MPS client.
set -uo pipefail
source benchmarks/device_prelude.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 575 python3 benchmarks/optimize_gpu.py --unit epoch --mps-client --iters 3 --repeats 1 --equality-iters 1 --budget-s 400 2>&1 | grep -v -iE "warn|warp" > $OUT/optimize_epoch.log; tail -32 $OUT/optimize_epoch.log
tar czf $OUT/results_f.tgz benchmarks/results/optimize_epoch 2>/dev/null; ls -la $OUT

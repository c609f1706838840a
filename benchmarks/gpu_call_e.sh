#!/usr/bin/env bash
# Device call E: which levers move the MJX iteration (issue 6), then the MPS measurements (issue 5).
set -uo pipefail
source benchmarks/device_prelude.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 290 python3 benchmarks/levers_gpu.py --variants base cb_loops cb_loops_min1 --budget-s 215 2>&1 | grep -v -iE "warn|warp" > $OUT/levers.log; tail -16 $OUT/levers.log
timeout 250 python3 benchmarks/mps_gpu.py --budget-s 200 2>&1 | grep -v -iE "warn|warp" > $OUT/mps_gpu.log; tail -22 $OUT/mps_gpu.log
tar czf $OUT/results_e.tgz benchmarks/results/levers benchmarks/results/mps 2>/dev/null; ls -la $OUT

#!/usr/bin/env bash
# Device call B: profiler (issue 4), MPS/runtime measurements (issue 5), their GPU tests. Repo root.
set -uo pipefail
source benchmarks/device_prelude.sh
timeout 300 python3 benchmarks/profile_gpu.py --num-envs 1024 8192 --budget-s 200 2>&1 | grep -v -iE "warn|warp" > $OUT/profile_gpu.log; tail -25 $OUT/profile_gpu.log
timeout 250 python3 benchmarks/mps_gpu.py --budget-s 220 2>&1 | grep -v -iE "warn|warp" > $OUT/mps_gpu.log; tail -25 $OUT/mps_gpu.log
timeout 75 python3 -m pytest -q -m gpu tests/test_mps.py tests/test_profile.py -p no:cacheprovider 2>&1 | tail -20 > $OUT/pytest_gpu.log; tail -8 $OUT/pytest_gpu.log
tar czf $OUT/results_b.tgz benchmarks/results/profile benchmarks/results/mps 2>/dev/null; ls -la $OUT

#!/usr/bin/env bash
# Device call H (issue 4 + issue 6): the sampler overhead of the process-mode NVML sampler on PPO / SAC
# ant iterations at 1024 envs (1 s blocks, sampler off / on in turns), the sampler GPU tests, then
# device call F at 8192 envs (the epoch optimizer). About 9 min on the H200:  bash benchmarks/gpu_call_h.sh
set -uo pipefail
source benchmarks/device_prelude.sh
timeout 150 python3 benchmarks/profile_gpu.py --overhead-only --algos sac ppo --num-envs 1024 \
  --overhead-rounds 2 --budget-s 90 2>&1 | grep -v -iE "warn|warp" > $OUT/sampler_overhead.log
tail -8 $OUT/sampler_overhead.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_profile.py -k "gpu_sampler" 2>&1 | tail -5 > $OUT/pytest_sampler.log
cat $OUT/pytest_sampler.log
tar czf $OUT/results_h.tgz benchmarks/results/profile/sampler_overhead.* 2>/dev/null
F_TIMEOUT=${F_TIMEOUT:-440} bash benchmarks/gpu_call_f.sh 8192

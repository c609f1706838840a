#!/usr/bin/env bash
# Device call A: foundation on the H200 (PPO throughput vs Brax, GPU tests). Run from the repo root.
set -uo pipefail
source benchmarks/device_prelude.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, brax, mujoco; print('jax', jax.__version__, jax.devices(), 'brax', brax.__version__, 'mujoco', mujoco.__version__)"
timeout 420 python3 -m benchmarks.train_throughput 2>&1 | grep -v -iE "warn|warp" | tee $OUT/train_throughput.log
cp benchmarks/results/train_throughput.* $OUT/ 2>/dev/null
timeout 150 python3 -m pytest -q -m gpu -x tests 2>&1 | tail -15

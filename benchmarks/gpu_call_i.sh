#!/usr/bin/env bash
# Device call I: one part of the `epoch` benchmark suite (issue 7: Brax's train loop, training epochs
# + evaluation; (a) Brax with its evaluations, (b) our jitted epoch, (d) the optimizer's plan), run as
# an MPS client. One row per part, under 10 min each:  bash benchmarks/gpu_call_i.sh 1   (then 2)
# Part files land in benchmarks/results/suite/epoch/part-i-of-2.*; with both parts in the working
# tree the second run also writes the merged results.* (or: python -m benchmarks.report --suite epoch).
set -uo pipefail
PART=${1:-1}
source benchmarks/device_prelude.sh
timeout 590 python3 -m benchmarks.run --suite epoch --part "$PART/2" --mps-client 2>&1 \
  | grep -v -iE "warn|warp" > $OUT/suite_epoch_$PART.log; tail -30 $OUT/suite_epoch_$PART.log
tar czf $OUT/results_i_$PART.tgz benchmarks/results/suite/epoch 2>/dev/null; ls -la $OUT

#!/usr/bin/env bash
# Device call D: the quick benchmark suite (issue 7). Run from the repo root.
set -uo pipefail
source benchmarks/device_prelude.sh
timeout 470 python3 -m benchmarks.run --suite quick --budget-s 360 2>&1 | grep -v -iE "warn|warp" > $OUT/suite_quick.log; tail -30 $OUT/suite_quick.log
tar czf $OUT/results_d.tgz benchmarks/results/suite 2>/dev/null; ls -la $OUT

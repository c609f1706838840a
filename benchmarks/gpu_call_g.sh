#!/usr/bin/env bash
# Device call G: the quick benchmark suite (issue 7); its in-process budget is the suite's (465 s).
set -uo pipefail
source benchmarks/device_prelude.sh
timeout 570 python3 -m benchmarks.run --suite quick 2>&1 | grep -v -iE "warn|warp" > $OUT/suite_quick.log; tail -30 $OUT/suite_quick.log
tar czf $OUT/results_g.tgz benchmarks/results/suite 2>/dev/null; ls -la $OUT

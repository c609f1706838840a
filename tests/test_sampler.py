"""rose_jax.profile.sampler's child process (mode="process"): it starts without re-importing the
user's ``__main__``, so a script with no ``if __name__ == "__main__":`` guard runs once.

Runs on any machine: without a GPU the child reports that it has no NVML (the script prints the
reason); with one it samples for a moment. Either way the script's body must run exactly once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from rose_jax.profile import sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    # no main guard, on purpose: a spawn child that re-imported this file would run it again
    import os, time
    from rose_jax.profile import sampler

    with open(os.environ["ROSE_TEST_MARK"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    try:
        with sampler.Sampler(period_ms=10) as s:
            time.sleep(0.3)
        print("SAMPLED", s.source, len(s.series().t_ns))
    except sampler.NoGPUError as e:
        print("NOGPU", e)
    """
)


def test_sampler_child_does_not_rerun_an_unguarded_main_script(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    mark = tmp_path / "runs.txt"
    env = dict(os.environ, ROSE_TEST_MARK=str(mark), PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-2000:]
    runs = mark.read_text().split()
    assert runs == [str(runs[0])] and len(runs) == 1, f"the script's body ran {len(runs)} times: {runs}"
    out = r.stdout.strip().splitlines()[-1]
    if sampler.available()[0]:
        assert out.startswith("SAMPLED"), out
    else:  # the child started, found no NVML and said so (not "did not start": it was not re-run)
        assert out.startswith("NOGPU no NVIDIA GPU/NVML") and "did not start" not in out, out

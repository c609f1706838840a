"""Run several slow child processes of one test module at the same time (CI has 2 cores, and a
child that compiles XLA programs keeps about one of them busy), each with its own output."""

from __future__ import annotations

import subprocess
import time

# XLA's fast compile, for children that test plumbing, not numerics, and spend their time compiling
# (MJX steps, Brax's trainers): less LLVM optimisation, so runtime-bound children get slower.
FAST_COMPILE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def run_together(commands: dict[str, tuple[list[str], dict]], cwd: str, timeout: float) -> dict:
    """``{name: (argv, env)}`` -> ``{name: CompletedProcess}`` (text stdout/stderr), started at once.

    A child still running when ``timeout`` seconds have passed (counted per child, from the wait for
    it) is killed, and the TimeoutExpired raised after every child is gone.
    """
    procs = {
        name: subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (argv, env) in commands.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():  # none left running, whatever happened above
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def gone(pid: int) -> bool:
    """The process has exited: no such process, or a zombie nobody reaped (a container's init). Reads
    ``/proc`` (Linux): tests using it skip elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def wait_gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether the process has exited within ``within_s`` seconds (:func:`gone`)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)

"""Owning an NVIDIA MPS control daemon: start, health check, quit, clean up on every exit path.

``MPSDaemon(run_dir)`` is a context manager. On enter it starts ``nvidia-cuda-mps-control -d``
with its own ``CUDA_MPS_PIPE_DIRECTORY`` (``run_dir/pipe``) and ``CUDA_MPS_LOG_DIRECTORY``
(``run_dir/log``), waits for the control socket and checks that the daemon answers
``get_server_list``. On exit (normal, exception, SIGINT/SIGTERM, a crashed worker) it sends
``quit``, waits for the control daemon and its ``nvidia-cuda-mps-server`` processes to exit
(escalating to SIGTERM/SIGKILL of *those* processes only), and removes its directories::

    with MPSDaemon("/tmp/rose-mps") as mps:
        with start_workers(specs, daemon=mps) as pool:   # workers get mps.client_env()
            ...

``rose_jax.runtime.ManagedPool(specs, mps=True)`` is the two blocks in one object.

It never touches a daemon it did not start: if ``run_dir/pipe`` already holds anything it
refuses to start. Quit waits for MPS clients: close the worker pool before the daemon (nesting
the two ``with`` blocks, or ``ManagedPool``, does that).

Signals: while running, SIGINT and SIGTERM handlers are installed (main thread only) and the
previous ones restored on stop. SIGINT raises ``KeyboardInterrupt`` (via the previous handler)
and SIGTERM raises ``SystemExit(143)`` where the previous disposition was the default, so the
stack unwinds through the ``with`` blocks: the worker pool closes first, then the daemon quits.
A previous custom handler is called instead; an ignored signal stays ignored. An ``atexit``
hook stops a daemon still running at interpreter exit.

``mps_status()`` says whether MPS can be used here, and if not, why (no binary, not
permitted, no GPU), so callers fall back to plain processes and report the reason.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

from rose_jax.mps.plan import MPS_LOG_VAR, MPS_PIPE_VAR

DEFAULT_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into the pipe directory
CONTROL_SOCKET = "control"
# A unix socket path is limited to 108 bytes; MPS puts several sockets under the pipe directory.
MAX_PIPE_DIR_LEN = 80


class MPSError(RuntimeError):
    """The MPS daemon could not be started, checked or stopped as asked."""


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """How a daemon stopped.

    clean: ``quit`` was accepted and every daemon process exited by itself within the timeout.
    quit_ok: the ``quit`` command returned 0.
    forced: pids that had to be signalled (SIGTERM, then SIGKILL).
    remaining: pids still alive after everything (should be empty).
    seconds: wall time of the shutdown.
    log_tail: last lines of the control log, kept because the log directory is removed.
    """

    clean: bool
    quit_ok: bool
    forced: tuple[int, ...]
    remaining: tuple[int, ...]
    seconds: float
    log_tail: str


def mps_status(binary: str = DEFAULT_BINARY) -> tuple[bool, str]:
    """(available, reason): can this process start an MPS daemon on a GPU here?

    Checks, in order: the control binary is on PATH and executable; NVML (or ``nvidia-smi``)
    sees at least one GPU; no GPU is in PROHIBITED compute mode. Every failing check is named
    in the reason; on success the reason lists the binary and the GPUs.
    """
    problems: list[str] = []
    path = shutil.which(binary) if os.sep not in binary else (binary if os.path.exists(binary) else None)
    if path is None:
        problems.append(f"{binary} not found on PATH")
    elif not os.access(path, os.X_OK):
        problems.append(f"not permitted to execute {path}")
    gpus, gpu_problem = _list_gpus()
    if gpu_problem:
        problems.append(gpu_problem)
    elif not gpus:
        problems.append("no NVIDIA GPU found")
    else:
        prohibited = [name for name, mode in gpus if mode == "prohibited"]
        if prohibited:
            problems.append(f"not permitted: compute mode PROHIBITED on {prohibited}")
    if problems:
        return False, "MPS unavailable: " + "; ".join(problems)
    names = ", ".join(f"{n} ({m})" for n, m in gpus)
    return True, f"MPS available: {path}; GPUs: {names}"


def _list_gpus() -> tuple[list[tuple[str, str]], str | None]:
    """[(name, compute mode)] from NVML, else from nvidia-smi; (gpus, problem or None)."""
    nvml_error = None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            modes = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                try:
                    mode = modes.get(pynvml.nvmlDeviceGetComputeMode(h), "unknown")
                except pynvml.NVMLError:
                    mode = "unknown"
                out.append((f"{i}:{name}", mode))
            return out, None
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no library, no driver, no device: all mean "no usable GPU" here
        nvml_error = f"{type(e).__name__}: {e}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], f"no GPU: NVML unavailable ({nvml_error}) and nvidia-smi not found"
    try:
        r = subprocess.run(
            [smi, "--query-gpu=index,name,compute_mode", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"no GPU: NVML unavailable ({nvml_error}); nvidia-smi failed ({e})"
    if r.returncode != 0:
        return (
            [],
            f"no GPU: NVML unavailable ({nvml_error}); nvidia-smi: {r.stderr.strip() or r.stdout.strip()}",
        )
    gpus = []
    for line in r.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append((f"{parts[0]}:{parts[1]}", parts[2].lower().replace(" ", "_")))
    return gpus, None


class MPSDaemon:
    """A context manager that owns one MPS control daemon (see the module docstring).

    run_dir: directory for this daemon's ``pipe`` and ``log`` subdirectories (created; removed
      on stop, and run_dir itself if this object created it and it is left empty).
    binary: the control program (name on PATH or a path).
    start_timeout / quit_timeout: seconds to wait for the control socket + health answer, and
      for the daemon processes to exit after ``quit`` before they are signalled.
    remove_run_dir: also remove run_dir on stop (if left empty) when it existed before start,
      e.g. a ``tempfile.mkdtemp`` made for this daemon.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        binary: str = DEFAULT_BINARY,
        *,
        start_timeout: float = 30.0,
        quit_timeout: float = 30.0,
        command_timeout: float = 15.0,
        handle_signals: bool = True,
        remove_run_dir: bool = False,
    ):
        self.run_dir = Path(run_dir).absolute()
        self.pipe_dir = self.run_dir / "pipe"
        self.log_dir = self.run_dir / "log"
        if len(str(self.pipe_dir)) > MAX_PIPE_DIR_LEN:
            raise ValueError(
                f"MPS pipe directory {self.pipe_dir} is {len(str(self.pipe_dir))} chars; unix sockets "
                f"need <= {MAX_PIPE_DIR_LEN}: use a shorter run_dir"
            )
        self.binary = binary
        self.start_timeout = float(start_timeout)
        self.quit_timeout = float(quit_timeout)
        self.command_timeout = float(command_timeout)
        self.handle_signals = handle_signals
        self.control_pid: int | None = None
        self.last_shutdown: ShutdownReport | None = None
        self._state = "new"  # new -> running -> stopped
        self._lock = threading.RLock()
        self._created_run_dir = bool(remove_run_dir)
        self._prev_handlers: dict[int, object] = {}
        self._known_pids: set[int] = set()

    # ------------------------------------------------------------------ public
    @property
    def running(self) -> bool:
        return self._state == "running"

    def client_env(self) -> dict[str, str]:
        """Variables an MPS client of this daemon needs (set before the client's CUDA init)."""
        return {MPS_PIPE_VAR: str(self.pipe_dir), MPS_LOG_VAR: str(self.log_dir)}

    def __enter__(self) -> "MPSDaemon":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "MPSDaemon":
        """Start the daemon and check that it answers; on any failure clean up and raise MPSError."""
        with self._lock:
            if self._state != "new":
                raise MPSError(f"MPSDaemon({self.run_dir}) was already {self._state}; make a new one")
            binary = self._resolve_binary()
            if self.pipe_dir.exists() and any(self.pipe_dir.iterdir()):
                raise MPSError(
                    f"MPS pipe directory {self.pipe_dir} is already in use (not empty): refusing to touch a "
                    "daemon this process did not start"
                )
            if not self.run_dir.exists():
                self._created_run_dir = True  # ours: removed on stop
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._state = "running"  # from here on stop() must run
            atexit.register(self.stop)
            try:
                # Output goes to a file, not a pipe: a daemonized child that kept the pipe open
                # would make us wait for an EOF that never comes.
                out_path = self.log_dir / "start.out"
                with open(out_path, "w") as out:
                    try:
                        r = subprocess.run(
                            [binary, "-d"],
                            env=self._env(),
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            timeout=self.command_timeout,
                        )
                    except subprocess.TimeoutExpired:
                        raise MPSError(
                            f"{binary} -d did not return within {self.command_timeout:.0f}s"
                        ) from None
                if r.returncode != 0:
                    text = out_path.read_text(errors="replace").strip()[:500]
                    raise MPSError(f"{binary} -d exited with {r.returncode}: {text}")
                self._wait_started()
                self._install_signal_handlers()
            except BaseException as e:
                self.stop()
                if isinstance(e, MPSError):
                    tail = self.last_shutdown.log_tail if self.last_shutdown else ""
                    raise MPSError(f"{e}{'; control log: ' + tail if tail else ''}") from None
                raise
            return self

    def server_pids(self) -> list[int]:
        """PIDs of this daemon's MPS servers (``get_server_list``); [] if it cannot answer."""
        ok, out = self._command("get_server_list")
        if not ok:
            return []
        return [int(tok) for tok in out.split() if tok.isdigit()]

    def healthy(self) -> bool:
        """True if the daemon is running and answers ``get_server_list``."""
        return self.running and self._command("get_server_list")[0]

    def stop(self) -> ShutdownReport | None:
        """Quit the daemon, wait for its processes, remove its directories. Idempotent."""
        with self._lock:
            if self._state != "running":
                return self.last_shutdown
            self._state = "stopping"
            t0 = time.monotonic()
            try:
                pids = self._our_pids()
                self._known_pids |= set(pids)
                quit_ok, _ = self._command("quit")
                remaining = _wait_gone(self._known_pids, self.quit_timeout if quit_ok else 1.0)
                forced = tuple(sorted(remaining))
                for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
                    if not remaining:
                        break
                    for pid in remaining:
                        _signal(pid, sig)
                    remaining = _wait_gone(remaining, grace)
                # a server may have been spawned between the scan and quit: look once more
                late = set(self._scan_processes()) - self._known_pids
                for pid in late:
                    _signal(pid, signal.SIGKILL)
                remaining |= _wait_gone(late, 3.0)
                forced = tuple(sorted(set(forced) | late))
                log_tail = self._log_tail()
                self.last_shutdown = ShutdownReport(
                    clean=quit_ok and not forced and not remaining,
                    quit_ok=quit_ok,
                    forced=forced,
                    remaining=tuple(sorted(remaining)),
                    seconds=time.monotonic() - t0,
                    log_tail=log_tail,
                )
            finally:
                shutil.rmtree(self.pipe_dir, ignore_errors=True)
                shutil.rmtree(self.log_dir, ignore_errors=True)
                if self._created_run_dir:
                    try:
                        self.run_dir.rmdir()
                    except OSError:
                        pass
                self._restore_signal_handlers()
                atexit.unregister(self.stop)
                self._state = "stopped"
            return self.last_shutdown

    # ----------------------------------------------------------------- helpers
    def _resolve_binary(self) -> str:
        path = shutil.which(self.binary) if os.sep not in self.binary else self.binary
        if path is None or not os.path.exists(path):
            raise MPSError(
                f"MPS control binary {self.binary!r} not found (mps_status() says why MPS is unusable)"
            )
        if not os.access(path, os.X_OK):
            raise MPSError(f"not permitted to execute {path}")
        return path

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env.update(self.client_env())
        return env

    def _command(self, command: str) -> tuple[bool, str]:
        """Send one control command (``echo command | nvidia-cuda-mps-control``)."""
        try:
            r = subprocess.run(
                [self._resolve_binary()],
                input=command + "\n",
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=self.command_timeout,
            )
        except (OSError, subprocess.TimeoutExpired, MPSError):
            return False, ""
        return r.returncode == 0, r.stdout

    def _wait_started(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        socket = self.pipe_dir / CONTROL_SOCKET
        while not socket.exists():
            if time.monotonic() > deadline:
                raise MPSError(f"MPS control socket {socket} did not appear within {self.start_timeout:.0f}s")
            time.sleep(0.02)
        while True:
            ok, _ = self._command("get_server_list")
            if ok:
                break
            if time.monotonic() > deadline:
                raise MPSError(f"MPS daemon at {self.pipe_dir} did not answer get_server_list (health check)")
            time.sleep(0.1)
        self.control_pid = self._read_pid_file()
        self._known_pids |= set(self._our_pids())
        if not self._known_pids:
            raise MPSError(f"MPS daemon at {self.pipe_dir} answered but no daemon process was found")

    def _read_pid_file(self) -> int | None:
        try:
            return int((self.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _our_pids(self) -> list[int]:
        """Daemon processes of *this* pipe directory: pid file, its descendants, env scan."""
        pids = set(self._scan_processes())
        if self.control_pid is not None and psutil.pid_exists(self.control_pid):
            pids.add(self.control_pid)
            try:
                pids |= {p.pid for p in psutil.Process(self.control_pid).children(recursive=True)}
            except psutil.Error:
                pass
        return sorted(pids)

    def _scan_processes(self) -> list[int]:
        """nvidia-cuda-mps-* processes whose CUDA_MPS_PIPE_DIRECTORY is ours (clients excluded)."""
        mine = str(self.pipe_dir)
        found = []
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                names = [p.info["name"] or ""] + [os.path.basename(a) for a in (p.info["cmdline"] or [])[:2]]
                if not any(n.startswith("nvidia-cuda-mps") for n in names):
                    continue
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if p.environ().get(MPS_PIPE_VAR) == mine:
                    found.append(p.pid)
            except psutil.Error:
                continue
        return found

    def _log_tail(self, lines: int = 20) -> str:
        path = self.log_dir / "control.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:  # leave alone if someone replaced ours
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers.clear()

    def _on_signal(self, signum, frame):
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        if prev == signal.SIG_IGN:
            return
        if callable(prev) and prev is not signal.default_int_handler:
            return prev(signum, frame)
        # Default disposition: unwind the stack so that enclosing with-blocks (worker pool, then
        # this daemon) clean up in order.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __repr__(self) -> str:
        return (
            f"MPSDaemon(run_dir={str(self.run_dir)!r}, state={self._state}, control_pid={self.control_pid})"
        )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(pids, timeout: float) -> set[int]:
    """Wait until none of pids is alive (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if _alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if _alive(p)}
    return left


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

"""`loom serve` in a process of its own (its own session, so a kill takes its workers too), for restart tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil


class Serving:
    """One `loom serve --json` process: its ServeInfo line, and ways to stop or kill it."""

    def __init__(self, plan_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "loomdata.cli", "serve", str(plan_dir), "--json", "--no-autoscale"]
        self._log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [*args, "--workers", "2", *extra],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"loom serve exited {self.proc.returncode}: {log.read_text()[-3000:]}")
        self.info: dict[str, Any] = json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def semaphores(self) -> set[Path]:
        """The named POSIX semaphores (/dev/shm/sem.*) the serve's processes have mapped and nobody has unlinked."""
        found: set[Path] = set()
        for p in _group(self.proc.pid):
            try:
                maps = Path(f"/proc/{p.pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/sem.") and not path[0].endswith(" (deleted)"):
                    found.add(Path(path[0]))
        return found

    def kill(self) -> None:
        """SIGKILL the serve and its worker processes (what an OOM killer or a lost node does)."""
        kill_session(self.proc)
        self.close()

    def stop(self) -> int:
        """SIGTERM: a clean stop; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.close()
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_session(self.proc)
        self._log.close()


def _is_tracker(p: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def kill_session(proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    """SIGKILL every process of `proc`'s group (it leads a session of its own) but multiprocessing's resource trackers.

    `os.killpg(SIGKILL)` took the trackers too, and a tracker is what unlinks the POSIX semaphores (/dev/shm/sem.mp-*)
    that the serve's Dask nannies create with the spawn context: every killed serve left them behind for good. Spared,
    a tracker reads EOF once the last process holding its pipe is dead, unlinks what is still registered, and exits;
    this waits for that (a tracker still alive after `timeout` is killed too, leaving its semaphores, as before).
    """
    deadline = time.monotonic() + timeout
    proc.kill()  # the serve first, so no nanny restarts a worker
    proc.wait(timeout=timeout)
    trackers: list[psutil.Process] = []
    while True:  # then whatever is left of its group, until nothing is
        group = _group(proc.pid)
        trackers = [p for p in group if _is_tracker(p)]
        victims = [p for p in group if p not in trackers]
        if not victims or time.monotonic() > deadline:
            break
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(victims, timeout=5)
    while trackers and time.monotonic() < deadline:
        trackers = [p for p in trackers if _alive(p)]
        time.sleep(0.05)
    for p in trackers:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

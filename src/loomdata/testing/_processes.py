"""Killing a serve's whole session without leaking its POSIX semaphores (for tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import psutil

__all__ = ["is_resource_tracker", "kill_session", "session_processes"]


def is_resource_tracker(p: psutil.Process) -> bool:
    """Whether `p` is a multiprocessing resource tracker (the process that unlinks a dead group's semaphores)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def session_processes(pgid: int) -> list[psutil.Process]:
    """The live processes of group `pgid` (a serve started with `start_new_session`: its nannies, workers, trackers)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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
        group = session_processes(proc.pid)
        trackers = [p for p in group if is_resource_tracker(p)]
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

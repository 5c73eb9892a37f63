"""`kill_session`: a killed session's POSIX semaphores are unlinked by its spared resource tracker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loomdata.testing._processes import kill_session, session_processes

_SESSION = """
import multiprocessing as mp, time
ctx = mp.get_context("spawn")
lock = ctx.Lock()  # a named POSIX semaphore, registered with this session's resource tracker
child = ctx.Process(target=time.sleep, args=(120,))
child.start()
print(lock._semlock.name, flush=True)
time.sleep(120)
"""


def _start() -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", _SESSION], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name, "the session printed no semaphore name"
    sem = Path("/dev/shm") / f"sem.{name.lstrip('/')}"
    assert sem.exists(), f"{sem} was not created: this test no longer checks what it claims"
    return proc, sem


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX semaphores are files under /dev/shm on Linux only")
def test_kill_session_leaves_no_semaphore_where_killpg_leaks_one() -> None:
    proc, sem = _start()
    os.killpg(proc.pid, signal.SIGKILL)  # the old way: the tracker dies too
    proc.wait(timeout=30)
    try:
        assert sem.exists(), "killpg no longer leaks the semaphore: the premise of kill_session changed"
    finally:
        sem.unlink(missing_ok=True)

    proc, sem = _start()
    kill_session(proc, timeout=30)
    assert not sem.exists(), f"kill_session left {sem} behind"
    assert not session_processes(proc.pid), "kill_session left processes of the session alive"

"""serve.lock: one `loom serve` per plan dir; a second is refused with the first one's pid.

The lock is a file made with O_EXCL holding the serve's pid, host and start time. A lock whose pid
is gone (the serve was killed) is taken over; released only by the serve that holds it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from loomdata.execution.protocol import ServeLock, lock_path, pid_alive, read_lock
from loomdata.schemas.errors import ExecutionError

__all__ = ["serve_lock"]


@contextlib.contextmanager
def serve_lock(plan_dir: Path) -> Iterator[ServeLock]:
    """Hold `plan_dir`'s serve.lock for the duration; ExecutionError naming the holder when it is taken."""
    mine = ServeLock(pid=os.getpid(), host=socket.gethostname(), started_at=time.time())
    p = lock_path(plan_dir)
    for _ in range(3):  # a stale lock removed, then a race lost to another serve: look again
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = read_lock(plan_dir)
            if held is not None and pid_alive(held.host, held.pid) is not False:
                raise ExecutionError(
                    f"plan dir {plan_dir} is already served by pid {held.pid} on {held.host} (since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held.started_at))}); stop that "
                    f"`loom serve` first (or, if it is gone, remove {p})"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # its serve is dead (or the lock half-written): take it over
            continue
        except OSError as e:
            raise ExecutionError(f"cannot create {p}: {e.strerror or e}; is the plan dir writable?") from None
        with os.fdopen(fd, "w") as f:
            f.write(mine.model_dump_json())
        break
    else:
        raise ExecutionError(f"could not take {p}: other serves keep starting on plan dir {plan_dir}")
    try:
        yield mine
    finally:
        if read_lock(plan_dir) == mine:
            p.unlink(missing_ok=True)

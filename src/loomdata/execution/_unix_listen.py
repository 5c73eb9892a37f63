"""A listening Unix socket in a fresh 0700 folder: the same-host endpoint of the rank gateway and of the loader link.

The folder is `tempfile.mkdtemp`'s (mode 0700, owned by this user, a name nobody else holds) and is removed at exit;
`sweep_stale` first removes what killed processes left under the same prefix. None where the platform has no Unix
sockets or peer credentials, where the path is too long for `sun_path`, or where binding fails: the caller then falls
back.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

__all__ = ["MAX_SOCKET_PATH", "STALE_AFTER_S", "listen_unix", "sweep_stale"]

MAX_SOCKET_PATH = 100
"""The longest socket path used (`sun_path` holds 108 bytes): a longer temporary folder gets no same-host endpoint."""

STALE_AFTER_S = 60.0
"""A folder untouched this long whose socket refuses connections is a killed process's."""


def listen_unix(
    prefix: str, name: str, log: logging.Logger, who: str, fallback: str
) -> tuple[Path, socket.socket] | None:
    """A non-blocking listening socket at `<fresh folder>/<name>` and its path; None where it cannot be had (logged
    to `log` at info: `who`, why, then `fallback`)."""
    if not hasattr(socket, "AF_UNIX") or not hasattr(socket, "SO_PEERCRED"):
        return None
    sweep_stale(Path(tempfile.gettempdir()), prefix, name)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    path = folder / name
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        shutil.rmtree(folder, ignore_errors=True)
        log.info("%s: none (%s is too long for a Unix socket); %s", who, path, fallback)
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(128)
        listener.setblocking(False)
    except OSError as e:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
        log.info("%s: none (%s: %s); %s", who, type(e).__name__, e, fallback)
        return None
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return path, listener


def sweep_stale(tmp: Path, prefix: str, name: str) -> None:
    """Remove this user's folders in `tmp` left by processes killed before their exit handlers: named as
    `mkdtemp(prefix=prefix)` names them, owned by this user, untouched for STALE_AFTER_S, and holding nothing or only
    a socket `name` that refuses connections. Anything else (another program's folder, a live socket, any other
    entry) is left alone."""
    shape = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}")
    uid = os.getuid()
    for folder in tmp.glob(f"{prefix}*"):
        if shape.fullmatch(folder.name) is None:
            continue
        try:
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or time.time() - st.st_mtime < STALE_AFTER_S:
                continue
            entries = os.listdir(folder)
            if entries:
                if entries != [name] or not _dead_socket(folder / name, uid):
                    continue
                os.unlink(folder / name)
            os.rmdir(folder)  # fails, and keeps it, if anything appeared in it meanwhile
        except OSError:  # gone meanwhile, or not ours to judge
            continue


def _dead_socket(path: Path, uid: int) -> bool:
    """Whether `path` is a Unix socket of uid `uid` that nobody listens on (connecting is refused)."""
    st = path.lstat()
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:  # alive with its backlog full, or not ours to judge
            return False
    return False  # connected: alive

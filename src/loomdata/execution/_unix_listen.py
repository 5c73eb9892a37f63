"""A listening Unix socket in a fresh 0700 folder: the same-host endpoint of the rank gateway and of the loader link.

The folder is `tempfile.mkdtemp`'s (mode 0700, owned by this user, a name nobody else holds) and is removed at exit;
its caller's `sweep` first removes what killed processes left. None where the platform has no Unix sockets or peer
credentials, where the path is too long for `sun_path`, or where binding fails: the caller then falls back.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["MAX_SOCKET_PATH", "listen_unix"]

MAX_SOCKET_PATH = 100
"""The longest socket path used (`sun_path` holds 108 bytes): a longer temporary folder gets no same-host endpoint."""


def listen_unix(
    prefix: str, name: str, sweep: Callable[[Path], None], log: logging.Logger, who: str, fallback: str
) -> tuple[Path, socket.socket] | None:
    """A non-blocking listening socket at `<fresh folder>/<name>` and its path; None where it cannot be had (logged
    to `log` at info: `who`, why, then `fallback`)."""
    if not hasattr(socket, "AF_UNIX") or not hasattr(socket, "SO_PEERCRED"):
        return None
    sweep(Path(tempfile.gettempdir()))
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

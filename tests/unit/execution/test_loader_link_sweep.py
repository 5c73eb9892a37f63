"""`_sweep_stale` removes only what a killed worker's link leaves: an old folder of mkdtemp's name for the link's
prefix, this user's, empty or holding only a `loader.sock` nobody listens on."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomdata.execution._loader_link import LINK_SOCKET, _sweep_stale

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs Unix sockets")


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="lks-", dir="/tmp") as d:  # short: a socket path holds 108 bytes
        yield Path(d)


def _folder(tmp: Path, name: str, *, sock: str | None = None, extra: bool = False) -> Path:
    folder = tmp / name
    folder.mkdir(mode=0o700)
    if sock is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(folder / LINK_SOCKET))
        if sock == "live":
            s.listen(8)
            _LIVE.append(s)
        else:
            s.close()  # the file stays: connecting is refused
    if extra:
        (folder / "notes.txt").write_text("someone else's")
    return folder


def _age(folder: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(folder, (t, t))


_LIVE: list[socket.socket] = []


def test_sweep_removes_only_dead_link_folders(tmp: Path) -> None:
    dead = _folder(tmp, "loom-link-dead0000", sock="dead")
    live = _folder(tmp, "loom-link-live0000", sock="live")
    empty = _folder(tmp, "loom-link-empty_00")
    other = _folder(tmp, "loom-link-other000", sock="dead", extra=True)
    young = _folder(tmp, "loom-link-young000", sock="dead")
    bench = _folder(tmp, "loom-link-bench-abcd1234")  # another prefix sharing ours: not mkdtemp's shape for it
    upper = _folder(tmp, "loom-link-ABCDEFGH")
    plain = tmp / "loom-link-file0000"
    plain.write_text("not a folder")
    for f in (dead, live, empty, other, bench, upper, plain):
        _age(f, 3600)
    try:
        _sweep_stale(tmp)
    finally:
        for s in _LIVE:
            s.close()
        _LIVE.clear()
    assert not dead.exists() and not empty.exists()
    assert (live / LINK_SOCKET).exists()
    assert (other / LINK_SOCKET).exists() and (other / "notes.txt").exists()
    assert (young / LINK_SOCKET).exists()
    assert bench.is_dir() and upper.is_dir() and plain.is_file()

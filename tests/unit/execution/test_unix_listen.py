"""`sweep_stale` removes only what a killed worker's same-host endpoint leaves (the rank gateway's and the loader
link's): an old folder of mkdtemp's name for the prefix, this user's, empty or holding only its socket, nobody
listening on it."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomdata.execution._unix_listen import sweep_stale

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs Unix sockets")

SOCK = "x.sock"


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="lks-", dir="/tmp") as d:  # short: a socket path holds 108 bytes
        yield Path(d)


_LIVE: list[socket.socket] = []


def _folder(tmp: Path, name: str, *, sock: str | None = None, extra: bool = False) -> Path:
    folder = tmp / name
    folder.mkdir(mode=0o700)
    if sock is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(folder / SOCK))
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


@pytest.mark.parametrize("prefix", ["loom-link-", "loom-gw-"])
def test_sweep_removes_only_dead_endpoint_folders(tmp: Path, prefix: str) -> None:
    dead = _folder(tmp, f"{prefix}dead0000", sock="dead")
    live = _folder(tmp, f"{prefix}live0000", sock="live")
    empty = _folder(tmp, f"{prefix}empty_00")
    other = _folder(tmp, f"{prefix}other000", sock="dead", extra=True)
    young = _folder(tmp, f"{prefix}young000", sock="dead")
    bench = _folder(tmp, f"{prefix}bench-abcd1234")  # another prefix sharing ours: not mkdtemp's shape for it
    upper = _folder(tmp, f"{prefix}ABCDEFGH")
    stranger = _folder(tmp, "not-ours-dead0000", sock="dead")
    plain = tmp / f"{prefix}file0000"
    plain.write_text("not a folder")
    for f in (dead, live, empty, other, bench, upper, stranger, plain):
        _age(f, 3600)
    try:
        sweep_stale(tmp, prefix, SOCK)
    finally:
        for s in _LIVE:
            s.close()
        _LIVE.clear()
    assert not dead.exists() and not empty.exists()
    assert (live / SOCK).exists()
    assert (other / SOCK).exists() and (other / "notes.txt").exists()
    assert (young / SOCK).exists() and (stranger / SOCK).exists()
    assert bench.is_dir() and upper.is_dir() and plain.is_file()

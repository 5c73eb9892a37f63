"""Identical range GETs in flight together are one request (`SharedGets`, used by `read_range`'s fsspec path)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pytest

from loomdata.storage import _fs, read_range, request_stats, reset_request_stats
from loomdata.storage._shared_gets import SharedGets

_DATA = bytes(range(256)) * 1024


def _until(cond: Callable[[], bool]) -> None:
    """Wait (at most 5 s) until `cond()` holds."""
    tick = threading.Event()
    for _ in range(500):
        if cond():
            return
        tick.wait(0.01)
    raise AssertionError("condition not reached in 5 s")


@pytest.fixture
def gated_mem(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, threading.Event, list[int]]]:
    """An in-memory object whose range GETs wait for the yielded event (so two callers' requests overlap), and
    the list each GET appends to as it starts waiting."""
    fs = fsspec.filesystem("memory")
    fs.pipe("/loomshared/blob.bin", _DATA)
    real = type(fs).cat_file
    go, entered = threading.Event(), []

    def gated(self: object, path: str, start: int | None = None, end: int | None = None, **kw: object) -> bytes:
        entered.append(1)
        go.wait(5)
        return real(self, path, start=start, end=end, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(type(fs), "cat_file", gated)
    reset_request_stats()
    yield "memory://loomshared/blob.bin", go, entered
    fs.rm("/loomshared", recursive=True)


def test_the_same_range_asked_twice_at_once_is_one_request(gated_mem: tuple[str, threading.Event, list[int]]) -> None:
    url, go, _ = gated_mem
    size, joined = len(_DATA), _fs._SHARED.joined
    with ThreadPoolExecutor(3) as pool:
        tail = [pool.submit(read_range, url, size - 65536, size) for _ in range(2)]
        other = pool.submit(read_range, url, 0, 100)  # another range: its own request
        _until(lambda: _fs._SHARED.joined > joined)  # the second tail read waits on the first's request
        go.set()
        assert [f.result() for f in tail] == [_DATA[-65536:]] * 2 and other.result() == _DATA[:100]
    assert request_stats()["get"] == 2 and request_stats()["get_bytes"] == 65536 + 100


def test_nothing_is_kept_once_a_request_finished(gated_mem: tuple[str, threading.Event, list[int]]) -> None:
    url, go, _ = gated_mem
    go.set()
    assert read_range(url, 0, 10) == read_range(url, 0, 10) == _DATA[:10]
    assert request_stats()["get"] == 2  # one after the other: two requests (an object may change between them)


def test_other_options_never_share_a_request(gated_mem: tuple[str, threading.Event, list[int]]) -> None:
    url, go, entered = gated_mem
    joined = _fs._SHARED.joined
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(read_range, url, 0, 10, {"memory": {"skip_instance_cache": True}})
        b = pool.submit(read_range, url, 0, 10)
        _until(lambda: len(entered) == 2 or _fs._SHARED.joined > joined)  # both in flight at once (or b joined a)
        go.set()
        assert a.result() == b.result() == _DATA[:10]
    assert request_stats()["get"] == 2 and _fs._SHARED.joined == joined


def test_a_joiner_tries_itself_when_the_request_it_joined_fails() -> None:
    shared = SharedGets()
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def failing() -> bytes:
        calls.append("first")
        started.set()
        release.wait(5)
        raise OSError("connection reset")

    def fine() -> bytes:
        calls.append("second")
        return b"ok"

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(shared.run, "k", failing)
        assert started.wait(5)
        second = pool.submit(shared.run, "k", fine)
        _until(lambda: shared.joined == 1)  # the second caller waits on the first's request
        release.set()
        with pytest.raises(OSError, match="connection reset"):
            first.result()
        assert second.result() == b"ok"
    assert calls == ["first", "second"] and shared.shared == 0


class _Interrupt(BaseException):
    """Stands for a KeyboardInterrupt in the first caller's thread."""


def test_an_interrupted_first_caller_does_not_interrupt_its_joiners() -> None:
    shared = SharedGets()
    started, release = threading.Event(), threading.Event()

    def interrupted() -> bytes:
        started.set()
        release.wait(5)
        raise _Interrupt

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(shared.run, "k", interrupted)
        assert started.wait(5)
        second = pool.submit(shared.run, "k", lambda: b"own")
        _until(lambda: shared.joined == 1)
        release.set()
        with pytest.raises(_Interrupt):
            first.result()
        assert second.result() == b"own"  # its own request, not the first caller's interrupt

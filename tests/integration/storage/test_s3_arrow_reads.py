"""Large S3 range reads through pyarrow's S3 client against a real S3-protocol server (moto on loopback)."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loomdata.storage import (
    ObjectNotFoundError,
    RetryPolicy,
    _arrow,
    _fs,
    open_ahead,
    read_range,
    request_latency,
    request_stats,
    reset_request_latency,
    reset_request_stats,
    warm_client,
)
from loomdata.storage._arrow import ARROW_MIN_READ, TRANSPORT_ENV, arrow_open, arrow_s3_kwargs, drop_handle
from loomtest.s3 import DroppingProxy, S3Server

BUCKET = "loom-arrow"
_DATA = np.random.default_rng(3).integers(0, 256, size=3 * ARROW_MIN_READ, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3cache")).start()
    server.boto3().create_bucket(Bucket=BUCKET)
    server.boto3().put_object(Bucket=BUCKET, Key="blob.bin", Body=_DATA)
    try:
        yield server
    finally:
        server.stop()


def test_a_large_read_goes_through_one_kept_pyarrow_handle(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{BUCKET}/blob.bin"
    drop_handle(url)
    reset_request_stats()
    a, b = ARROW_MIN_READ // 3, ARROW_MIN_READ // 3 + ARROW_MIN_READ
    assert read_range(url, a, b) == _DATA[a:b]
    assert read_range(url, 2 * ARROW_MIN_READ, 3 * ARROW_MIN_READ) == _DATA[2 * ARROW_MIN_READ :]
    assert request_stats() == {"head": 1, "get": 2, "get_bytes": 2 * ARROW_MIN_READ}  # one HEAD: the handle is kept
    reset_request_stats()
    assert read_range(url, 0, 100) == _DATA[:100]  # small: one fsspec GET, no handle
    monkeypatch.setenv(TRANSPORT_ENV, "fsspec")
    assert read_range(url, a, b) == _DATA[a:b]  # the same bytes through s3fs
    assert request_stats() == {"get": 2, "get_bytes": 100 + ARROW_MIN_READ}


def test_a_handle_opened_ahead_makes_the_first_large_read_one_request(s3: S3Server) -> None:
    """A loader opens its shards' handles ahead (`open_ahead`): the HEAD is paid there, not by the first read."""
    url = f"s3://{BUCKET}/blob.bin"
    drop_handle(url)
    reset_request_stats()
    open_ahead(url, size=len(_DATA) // 4)  # smaller than any large read: nothing to open
    open_ahead("/local/file.parquet")
    assert request_stats() == {}
    open_ahead(url, size=len(_DATA))
    assert request_stats() == {"head": 1}
    reset_request_stats()
    assert read_range(url, 0, ARROW_MIN_READ, size=len(_DATA)) == _DATA[:ARROW_MIN_READ]
    assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}  # no HEAD on the read
    drop_handle(url)
    with pytest.raises(ObjectNotFoundError, match=rf"s3://{BUCKET}/nope.bin: open"):  # a missing object, named
        open_ahead(f"s3://{BUCKET}/nope.bin")


def test_a_large_read_while_the_handle_is_opening_goes_through_fsspec_at_once(s3: S3Server) -> None:
    """A shard's first row group, asked while its open (another thread) still waits on pyarrow's HEAD, in a process
    that has made s3fs's client: one GET through s3fs now, not a second HEAD or a wait for that one; once the handle
    is open, reads use it."""
    url = f"s3://{BUCKET}/blob.bin"
    drop_handle(url)
    warm_client(url)  # s3fs's client made: the read need not wait for the HEAD
    kwargs = arrow_s3_kwargs({})
    assert kwargs is not None
    opening, release = threading.Event(), threading.Event()

    def held_open() -> None:  # the HEAD's callback: the open stays in progress until released
        opening.set()
        assert release.wait(20)

    opener = threading.Thread(target=arrow_open, args=(url, kwargs, held_open))
    opener.start()
    try:
        assert opening.wait(20)
        reset_request_stats()
        assert read_range(url, 0, ARROW_MIN_READ, size=len(_DATA)) == _DATA[:ARROW_MIN_READ]
        assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}  # through s3fs: no HEAD of its own
    finally:
        release.set()
        opener.join(20)
    reset_request_stats()
    assert (
        read_range(url, ARROW_MIN_READ, 2 * ARROW_MIN_READ, size=len(_DATA))
        == _DATA[ARROW_MIN_READ : 2 * ARROW_MIN_READ]
    )
    assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}  # the handle the open made: no HEAD


def test_without_an_s3fs_client_a_large_read_waits_for_the_handle_being_opened(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same read in a process that has not made s3fs's client for these options (a loader that reads only through
    pyarrow does not make it, ~0.3 s of CPU): it waits for the open in flight and reads through its handle, one GET,
    no second HEAD, no s3fs client made. The storage latency it records is its GET's alone, not that wait's."""
    url = f"s3://{BUCKET}/blob.bin"
    opts = s3.options()  # options no other test of this module makes a client with
    kwargs = arrow_s3_kwargs(opts["s3"])
    assert kwargs is not None and not _fs._client_made(url, opts)
    drop_handle(url)
    opening, release, waiting = threading.Event(), threading.Event(), threading.Event()
    real_wait, real_clock = _arrow._OPENED.wait_for, time.perf_counter
    skew = [0.0]

    def wait_for(predicate: Any, timeout: float | None = None) -> Any:
        skew[0] += 60.0  # the clocks see this wait take a minute (no real sleep): only a timed wait records it
        waiting.set()
        return real_wait(predicate, timeout)

    monkeypatch.setattr(_arrow._OPENED, "wait_for", wait_for)
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + skew[0])

    def held_open() -> None:
        opening.set()
        assert release.wait(20)

    got: list[bytes] = []
    opener = threading.Thread(target=arrow_open, args=(url, kwargs, held_open))
    opener.start()
    reader = threading.Thread(target=lambda: got.append(read_range(url, 0, ARROW_MIN_READ, opts, size=len(_DATA))))
    try:
        assert opening.wait(20)
        reset_request_stats()
        reset_request_latency()
        reader.start()
        assert waiting.wait(20)  # waiting for the HEAD in flight, not reading through s3fs
        assert not got and request_stats() == {}
        release.set()
        reader.join(20)
        assert not reader.is_alive()
    finally:
        release.set()
        opener.join(20)
        reader.join(20)
    assert got == [_DATA[:ARROW_MIN_READ]]
    assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}, request_stats()  # the opener's handle
    assert not _fs._client_made(url, opts)
    assert 0 < request_latency([url]) < 60.0  # the GET, not the minute its wait took


def test_a_reset_mid_response_is_retried_and_a_rewritten_object_is_read_afresh(s3: S3Server) -> None:
    proxy = DroppingProxy(s3.port, drops=2, cut=4096)
    url = f"s3://{BUCKET}/blob.bin"
    opts = {"s3": {"endpoint_url": proxy.endpoint}}
    try:
        policy = RetryPolicy(attempts=6, base_s=0.01, max_s=0.05)
        assert read_range(url, 0, 2 * ARROW_MIN_READ, opts, policy) == _DATA[: 2 * ARROW_MIN_READ]
        assert proxy.dropped >= 1, (proxy.dropped, proxy.connections)
    finally:
        proxy.close()
    shorter = _DATA[: 2 * ARROW_MIN_READ]
    s3.boto3().put_object(Bucket=BUCKET, Key="blob.bin", Body=shorter)
    try:  # the kept handle says 3 x ARROW_MIN_READ; a reader that opened the object since knows its new size
        reset_request_stats()
        assert read_range(url, ARROW_MIN_READ, 2 * ARROW_MIN_READ, size=len(shorter)) == shorter[ARROW_MIN_READ:]
        assert request_stats()["head"] == 1, request_stats()  # the handle was opened afresh
        reset_request_stats()  # past the end its handle knows: read through fsspec, which returns what is there
        assert read_range(url, ARROW_MIN_READ, 3 * ARROW_MIN_READ) == shorter[ARROW_MIN_READ:]
        assert request_stats()["get"] == 1, request_stats()
    finally:
        s3.boto3().put_object(Bucket=BUCKET, Key="blob.bin", Body=_DATA)
        drop_handle(url)


def test_a_missing_object_names_its_url(s3: S3Server, tmp_path: Path) -> None:
    from loomdata.storage import ObjectNotFoundError

    with pytest.raises(ObjectNotFoundError, match=rf"s3://{BUCKET}/nope.bin: read of bytes 0\.\.{ARROW_MIN_READ}"):
        read_range(f"s3://{BUCKET}/nope.bin", 0, ARROW_MIN_READ)


_REGION = {"client_kwargs": {"region_name": "us-east-1"}}
"""Options whose pyarrow filesystem is another than the default's: a second handle of one object, kept apart."""


def test_a_read_while_a_handle_is_opened_elsewhere_drops_no_kept_handle(s3: S3Server) -> None:
    """A large read that finds its handle being opened by another thread goes through fsspec and drops nothing:
    neither the handle being opened nor another kept handle of the object (each pays its HEAD once)."""
    url = f"s3://{BUCKET}/blob.bin"
    drop_handle(url)
    warm_client(url, {"s3": _REGION})  # s3fs's client made: the read goes through it rather than wait
    plain, other = arrow_s3_kwargs({}), arrow_s3_kwargs(_REGION)
    assert plain is not None and other is not None and plain != other
    assert arrow_open(url, plain, lambda: None)
    entered, gate = threading.Event(), threading.Event()

    def held_open() -> None:
        entered.set()
        assert gate.wait(30)

    opening = threading.Thread(target=arrow_open, args=(url, other, held_open))
    opening.start()
    try:
        assert entered.wait(30)
        reset_request_stats()
        assert read_range(url, 0, ARROW_MIN_READ, {"s3": _REGION}) == _DATA[:ARROW_MIN_READ]
        assert request_stats() == {"get": 1, "get_bytes": ARROW_MIN_READ}  # through fsspec, no HEAD
    finally:
        gate.set()
        opening.join(30)
    reset_request_stats()
    assert read_range(url, ARROW_MIN_READ, 2 * ARROW_MIN_READ) == _DATA[ARROW_MIN_READ : 2 * ARROW_MIN_READ]
    assert read_range(url, 0, ARROW_MIN_READ, {"s3": _REGION}) == _DATA[:ARROW_MIN_READ]
    assert request_stats() == {"get": 2, "get_bytes": 2 * ARROW_MIN_READ}  # both handles kept: no HEAD


def test_a_forked_child_starts_with_no_handle_open_or_held_lock(s3: S3Server) -> None:
    """A child forked while the parent keeps a handle, opens another and holds the lock has none of them."""
    url = f"s3://{BUCKET}/blob.bin"
    plain, other = arrow_s3_kwargs({}), arrow_s3_kwargs(_REGION)
    assert plain is not None and other is not None
    drop_handle(url)
    assert arrow_open(url, plain, lambda: None)
    entered, gate = threading.Event(), threading.Event()

    def held_open() -> None:
        entered.set()
        assert gate.wait(30)

    opening = threading.Thread(target=arrow_open, args=(url, other, held_open))
    opening.start()
    try:
        assert entered.wait(30)
        assert _arrow._HANDLES and _arrow._OPENING and _arrow._FILESYSTEMS
        with warnings.catch_warnings(), _arrow._LOCK:  # held at the fork
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only reads state
            pid = os.fork()
            if pid == 0:  # the child: no pytest here, only an exit status
                fresh = not (_arrow._HANDLES or _arrow._OPENING or _arrow._FILESYSTEMS)
                free = _arrow._LOCK.acquire(blocking=False)
                os._exit(0 if fresh and free else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        gate.set()
        opening.join(30)
    assert len([k for k in _arrow._HANDLES if k[1] == url]) == 2  # the parent's own are untouched


def test_a_forked_child_has_made_no_s3fs_client_and_holds_no_connect_lock() -> None:
    """A child forked while a parent thread makes an s3fs client (`_CONNECT_LOCK` held) and after one was made
    (`_MADE`) can make its own: the lock is free and no client counts as made."""
    made = set(_fs._MADE)
    _fs._MADE.add(b"parent's options")
    try:
        with warnings.catch_warnings(), _fs._CONNECT_LOCK:  # held at the fork
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only reads state
            pid = os.fork()
            if pid == 0:  # the child: no pytest here, only an exit status
                free = _fs._CONNECT_LOCK.acquire(blocking=False)
                os._exit(0 if free and not _fs._MADE else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert b"parent's options" in _fs._MADE  # the parent's own are untouched
    finally:
        _fs._MADE.intersection_update(made)


def test_a_failed_open_wakes_the_read_waiting_for_it_which_opens_its_own_handle(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read waiting for another thread's open (no s3fs client made) is woken when that open fails, not held until
    `OPEN_WAIT_S`: it opens the handle itself (one HEAD) and reads the right bytes; the opener's error is its own."""
    url = f"s3://{BUCKET}/blob.bin"
    monkeypatch.setattr(_fs, "_MADE", set())  # as in a fresh worker: no s3fs client made yet
    kwargs = arrow_s3_kwargs({})
    assert kwargs is not None
    drop_handle(url)
    opening, release, waiting = threading.Event(), threading.Event(), threading.Event()
    real_wait = _arrow._OPENED.wait_for

    def wait_for(predicate: Any, timeout: float | None = None) -> Any:
        waiting.set()
        return real_wait(predicate, timeout)

    monkeypatch.setattr(_arrow._OPENED, "wait_for", wait_for)

    def failing_open() -> None:
        opening.set()
        assert release.wait(20)
        raise OSError("simulated HEAD failure")

    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            arrow_open(url, kwargs, failing_open)
        except OSError as e:
            errors.append(e)

    got: list[bytes] = []
    opener = threading.Thread(target=open_it)
    reader = threading.Thread(target=lambda: got.append(read_range(url, 0, ARROW_MIN_READ, size=len(_DATA))))
    opener.start()
    try:
        assert opening.wait(20)
        reset_request_stats()
        reader.start()
        assert waiting.wait(20) and not got  # waiting for the open in flight
        release.set()
        reader.join(20)
        assert not reader.is_alive()  # woken by the failure (OPEN_WAIT_S is 30 s)
    finally:
        release.set()
        opener.join(20)
        reader.join(20)
    assert [str(e) for e in errors] == ["simulated HEAD failure"]
    assert got == [_DATA[:ARROW_MIN_READ]]
    assert request_stats() == {"head": 1, "get": 1, "get_bytes": ARROW_MIN_READ}, request_stats()  # its own open
    assert not _fs._MADE  # still no s3fs client

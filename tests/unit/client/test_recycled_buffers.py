"""A rank's large receive buffers are used again once nothing refers to them (no fresh pages to fault in per answer)."""

from __future__ import annotations

import pickle
import socket

import numpy as np
import pytest

from loomdata.client import _direct
from loomdata.client._direct import RECYCLE_BYTES, RECYCLE_MAX_BYTES, _Frame, _Recycled
from loomdata.execution._wire import ANSWER, encode_answer


def _base(buf: bytearray | memoryview) -> bytearray:
    return buf.obj if isinstance(buf, memoryview) else buf  # type: ignore[return-value]


def test_a_buffer_is_reused_only_once_no_array_or_tensor_refers_to_it() -> None:
    torch = pytest.importorskip("torch")
    assert _direct._FREE_REFS is not None  # this interpreter's counts tell (else recycling is off, tested below)
    pool = _Recycled(keep=2)
    n = RECYCLE_BYTES * 2
    first = pool.get(n)
    arr = np.frombuffer(first, dtype=np.int32)
    del first
    second = pool.get(n)
    assert _base(second) is not _base(pool._buffers[0]) and pool.reused == 0  # `arr` still sees the first one
    tensor = torch.from_numpy(arr[10:20])  # a tensor of a view of it holds it as well
    del arr
    pool.get(n)
    assert pool.reused == 0  # the tensor's buffer was not handed out again (a new one was made)
    del tensor
    del second
    again = pool.get(n - 8)  # now free: its first n - 8 bytes, no new memory
    assert pool.reused == 1 and isinstance(again, memoryview) and len(again) == n - 8
    assert len(pool._buffers) == 2  # never more than `keep`


def test_small_and_much_smaller_requests_get_buffers_of_their_own() -> None:
    pool = _Recycled()
    small = pool.get(RECYCLE_BYTES - 1)
    assert isinstance(small, bytearray) and pool._buffers == []  # the heap's free lists serve these
    big = pool.get(RECYCLE_BYTES * 4)
    del big
    assert len(pool.get(RECYCLE_BYTES)) == RECYCLE_BYTES and pool.reused == 0  # a quarter of it: not held for that


def test_answers_received_into_recycled_buffers_keep_their_values() -> None:
    """Arrays of an answer still held are never overwritten by later answers; freed buffers are filled anew."""
    a, b = socket.socketpair()
    frame = _Frame()
    kept = []
    try:
        for k in range(6):
            value = {"ids": np.full(RECYCLE_BYTES // 4 + 6 - k, k, dtype=np.int32)}  # each fits the ones before
            a.sendall(b"".join(bytes(memoryview(p).cast("B")) for p in encode_answer(k, value)))
            got = None
            while got is None:
                got = frame.feed(b, "test")
            kind, request_id, answer = got
            assert (kind, request_id) == (ANSWER, k)
            assert np.array_equal(answer["ids"], value["ids"])
            if k % 2 == 0:
                kept.append((k, answer["ids"]))  # held by the "training loop"
            del got, answer  # the others dropped
        assert frame.recycled.reused > 0
        for k, ids in kept:
            assert (ids == k).all() and len(ids) == RECYCLE_BYTES // 4 + 6 - k
        assert pickle.loads(pickle.dumps(kept[0][1])).tolist() == kept[0][1].tolist()
    finally:
        a.close()
        b.close()


def test_recycling_is_off_where_reference_counts_cannot_tell_and_for_huge_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interpreter whose counts do not see one more holder (no GIL, borrowed references) gets fresh buffers only;
    a buffer above RECYCLE_MAX_BYTES is never kept."""
    monkeypatch.setattr(_direct, "_FREE_REFS", None)
    pool = _Recycled()
    for _ in range(3):
        pool.get(RECYCLE_BYTES * 2)
    assert pool.keep == 0 and pool._buffers == [] and pool.reused == 0
    monkeypatch.undo()
    pool = _Recycled()
    pool.get(RECYCLE_MAX_BYTES + 1)
    assert pool._buffers == []

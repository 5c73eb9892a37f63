"""The read/route protocol's pure parts: sorting a failed call, routing samples to partitions, requests."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, ClassVar

import numpy as np
import pytest

from loomdata.execution._loader import LoaderRetired, SegmentData
from loomdata.execution._manifest import ManifestRows
from loomdata.execution._outcome import Kind as Outcome
from loomdata.execution._outcome import sort_read_failure as classify
from loomdata.execution._pack_group import split_answers
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._reads import REMOTE_READS, Reads, Route
from loomdata.schemas import ExecutionError, SourceDataError


@pytest.mark.parametrize(
    ("error", "stale", "outcome"),
    [
        (SourceDataError("a.parquet", "corrupt", row=3), False, Outcome.ERROR),
        (ExecutionError("sample 9 is not in loader part 0"), False, Outcome.ERROR),
        (LoaderRetired("retired"), False, Outcome.REFUSED),
        (OSError("Unable to contact Actor's worker"), False, Outcome.LOST),
        (TimeoutError(), False, Outcome.LOST),
        (KeyError("actor-abc"), False, Outcome.LOST),
        (OSError("comm closed"), True, Outcome.REFUSED),
        (ExecutionError("released actor"), True, Outcome.REFUSED),  # issued on a replaced route
    ],
)
def test_classify(error: Exception, stale: bool, outcome: Outcome) -> None:
    assert classify(error, stale=stale) is outcome


def _parts(bounds: list[int]) -> list[LoaderPartition]:
    return [
        LoaderPartition(source_id=0, source="s", part=i, first_shard=i, stop_shard=i + 1, first_sample=a, stop_sample=b)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def test_route_sends_each_sample_to_its_partition() -> None:
    route = Route(_parts([0, 10, 25, 40]), loaders=[None, None, None])
    assert route.part_of(np.array([0, 9, 10, 24, 25, 39], dtype=np.uint64)).tolist() == [0, 0, 1, 1, 2, 2]


class _Echo:
    """A remote loader stand-in recording the requests it is sent; a read may wait for `gate`."""

    live: ClassVar[list[int]] = [0, 0]  # reads in flight now, most at once

    def __init__(self, name: str, gate: asyncio.Event | None = None) -> None:
        self.name, self.got, self.gate = name, [], gate

    async def read(self, request: np.ndarray) -> str:
        self.got.append(request)
        _Echo.live[0] += 1
        _Echo.live[1] = max(_Echo.live)
        if self.gate is not None:
            await self.gate.wait()
        _Echo.live[0] -= 1
        return self.name


def _rows(source: list[int], sample: list[int]) -> ManifestRows:
    n = len(source)
    z = np.zeros(n, dtype=np.uint32)
    return ManifestRows(
        step=z,
        dp_rank=z,
        micro_batch=z,
        source=np.asarray(source, dtype=np.uint16),
        sample=np.asarray(sample, dtype=np.uint64),
        offset=np.arange(n, dtype=np.uint32),
        length=np.full(n, 2, dtype=np.uint32),
        lane=z,
    )


def test_one_request_per_source_partition_in_row_order() -> None:
    a0, a1, b0 = _Echo("a0"), _Echo("a1"), _Echo("b0")
    reads = Reads({0: Route(_parts([0, 10, 20]), [a0, a1]), 1: Route(_parts([0, 50]), [b0])}, plan_id="p")
    rows = _rows([1, 0, 0, 0, 1], [7, 12, 3, 15, 8])
    groups, calls = reads._requests(rows)

    async def answers() -> list[Any]:
        return list(await asyncio.gather(*calls))

    assert [g.tolist() for g in groups] == [[2], [1, 3], [0, 4]] and asyncio.run(answers()) == ["a0", "a1", "b0"]
    assert a1.got[0]["sample"].tolist() == [12, 15] and a1.got[0]["offset"].tolist() == [1, 3]
    assert b0.got[0]["length"].tolist() == [2, 2]


def test_remote_reads_in_flight_are_bounded_per_process() -> None:
    """A step over hundreds of sources must not open hundreds of connections at once."""

    async def run() -> tuple[int, int, list[Any]]:
        gate = asyncio.Event()
        n = 3 * REMOTE_READS
        reads = Reads({0: Route(_parts(list(range(n + 1))), [_Echo(f"l{i}", gate) for i in range(n)])}, plan_id="p")
        _Echo.live[:] = [0, 0]
        _, calls = reads._requests(_rows([0] * n, list(range(n))))
        task = asyncio.ensure_future(asyncio.gather(*calls))
        for _ in range(20):  # let every read that can start, start
            await asyncio.sleep(0)
        waiting = _Echo.live[0]
        gate.set()
        return waiting, _Echo.live[1], list(await task)

    waiting, most, got = asyncio.run(run())
    assert waiting == REMOTE_READS and most == REMOTE_READS
    assert got == [f"l{i}" for i in range(3 * REMOTE_READS)]  # every read answered, in request order


def test_a_source_without_a_route_is_an_error() -> None:
    reads = Reads({0: Route(_parts([0, 10]), [_Echo("a")])}, plan_id="p")
    with pytest.raises(ExecutionError, match="no loader serves source id 3 of plan p"):
        reads._requests(_rows([3], [1]))
    assert classify(ExecutionError("x")) is Outcome.ERROR


def test_answers_for_several_steps_split_back_into_each_steps_answers() -> None:
    # 3 steps of 2, 3 and 2 rows; two requests (partitions) across all of them, rows ascending in each
    lengths = np.array([2, 1, 3, 2, 1, 4, 2], dtype=np.uint32)
    bounds = [0, 2, 5, 7]
    sel_a, sel_b = np.array([0, 2, 3, 6]), np.array([1, 4, 5])
    tok_a = np.arange(100, 100 + int(lengths[sel_a].sum()), dtype=np.int32)
    tok_b = np.arange(200, 200 + int(lengths[sel_b].sum()), dtype=np.int32)
    img = [np.full((1, 2), k, dtype=np.float32) for k in range(3)]
    data_a = SegmentData(tok_a, img, np.array([1, 3, 3], dtype=np.int32), np.array([0, 0, 1], dtype=np.int32))
    data_b = SegmentData(tok_b)
    parts = split_answers(lengths, bounds, ([sel_a, sel_b], [data_a, data_b]))
    assert len(parts) == 3
    (g0, d0), (g1, d1), (g2, d2) = parts
    assert [g.tolist() for g in g0] == [[0], [1]] and d0[0].tokens.tolist() == [100, 101]
    assert d0[1].tokens.tolist() == [200] and d0[0].images == []
    assert [g.tolist() for g in g1] == [[0, 1], [2]]  # step 1's rows 2, 3 (request a), 4 (b), relative
    assert d1[0].tokens.tolist() == [102, 103, 104, 105, 106]
    assert d1[0].image_segment.tolist() == [0] and d1[0].images[0][0, 0] == 0
    assert d1[1].tokens.tolist() == [201]
    assert [g.tolist() for g in g2] == [[1], [0]] and d2[0].tokens.tolist() == [107, 108]
    assert d2[0].image_segment.tolist() == [0, 0] and d2[0].image_offset.tolist() == [0, 1]
    assert [im[0, 0] for im in d2[0].images] == [1, 2]
    assert d2[1].tokens.tolist() == [202, 203, 204, 205]
    assert np.shares_memory(d1[0].tokens, tok_a)  # views, no copy


def test_several_steps_rows_concatenate_in_order() -> None:
    a, b = _rows([0, 0], [5, 6]), _rows([0], [7])
    both = ManifestRows.concat([a, b])
    assert both.sample.tolist() == [5, 6, 7] and len(both) == 3
    assert ManifestRows.concat([a]) is a

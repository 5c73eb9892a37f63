"""StreamClient against a running executor: exact batches, resume from a saved state, peers, reconnect."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import Batch, ContractError, read_manifest, read_plan
from loomdata.testing import verify_resume


def _same(a: Batch, b: Batch) -> None:
    assert (a.step, a.dp_rank, a.micro_batch, a.lane) == (b.step, b.dp_rank, b.micro_batch, b.lane)
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_client_yields_the_ranks_batches_in_order(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    meta = oracle.meta
    with Executor(stream_plan, dask_client), StreamClient(stream_plan, 1) as stream:
        assert len(stream) == meta.steps * meta.micro_batches
        got = list(stream)
        assert stream.wait_s >= 0
    assert [(b.step, b.micro_batch) for b in got] == [
        (s, m) for s in range(meta.steps) for m in range(meta.micro_batches)
    ]
    assert all(b.dp_rank == 1 for b in got)
    assert sum(oracle.check(b) for b in got) == sum(
        read_manifest(stream_plan, meta, dp_ranks=[1]).column("length").to_numpy().astype(int)
    )


def test_the_first_call_asks_a_few_steps_and_the_rest_at_once(dask_client: Client, stream_plan: Path) -> None:
    """The first call asks FIRST_CALL_STEPS steps, not half a window; the next goes out from the first step not
    received, asking a whole call's count; without prefetch every call asks the window; the stream is every step."""
    from loomdata.client._stream import FIRST_CALL_STEPS

    meta = read_plan(stream_plan)
    for prefetch in (True, False):
        with (
            Executor(stream_plan, dask_client, window=16) as ex,
            StreamClient(stream_plan, 0, prefetch=prefetch) as stream,
        ):
            assert ex.window // 2 > FIRST_CALL_STEPS  # a call would ask for more steps than the first one does
            asked: list[tuple[int, int]] = []
            take = stream._take

            def recorded(step: int, count: int, take: Any = take, asked: list[tuple[int, int]] = asked) -> Any:
                asked.append((step, count))
                return take(step, count)

            stream._take = recorded  # type: ignore[method-assign]
            got = list(stream)
            if prefetch:
                assert asked[0] == (0, FIRST_CALL_STEPS)
                # from the first step the first answer did not hold (a cold worker may have built only step 0)
                assert 1 <= asked[1][0] <= FIRST_CALL_STEPS and asked[1][1] > FIRST_CALL_STEPS, asked
            else:
                assert asked[0][1] > FIRST_CALL_STEPS, asked  # the whole window's count from the start
        assert [(b.step, b.micro_batch) for b in got] == [
            (s, m) for s in range(meta.steps) for m in range(meta.micro_batches)
        ]


def test_state_dict_resume_gives_identical_batches(dask_client: Client, stream_plan: Path) -> None:
    with Executor(stream_plan, dask_client):
        with StreamClient(stream_plan, 0) as first:
            head = [next(first) for _ in range(3)]  # stops mid-step (2 micro-batches per step)
            state = first.state_dict()
            rest = list(first)
        assert state["step"] == 1 and state["micro_batch"] == 1 and state["dp_rank"] == 0
        with StreamClient(stream_plan, 0) as resumed:
            resumed.load_state_dict(state)
            again = list(resumed)
    assert len(head) + len(rest) == len(again) + 3
    assert len(again) == len(rest) > 0
    for a, b in zip(rest, again, strict=True):
        _same(a, b)


def test_load_state_dict_rejects_another_plan_or_version(stream_plan: Path) -> None:
    stream = StreamClient(stream_plan, 0)  # no connection is made before iterating
    state = stream.state_dict()
    with pytest.raises(ContractError, match=r"plan other.*this client streams plan " + state["plan_id"]):
        stream.load_state_dict({**state, "plan_id": "other"})
    with pytest.raises(ContractError, match=r"version 99 is not supported.*writes version 1"):
        stream.load_state_dict({**state, "version": 99})
    with pytest.raises(ContractError, match="dp rank 1"):
        stream.load_state_dict({**state, "dp_rank": 1})


def _after_ahead_build(ex: Executor, ranks: list[int], steps: int, timeout_s: float = 60.0) -> Any:
    """The executor's metrics once the constructor of `ranks` has built its first `steps` steps ahead (it builds
    them on its own, so reading the metrics right after the ranks stop may come before it has)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = ex.metrics()
        c = next(c for c in m.constructors if c.ranks == ranks)
        if c.built_steps >= steps or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("bytes_in_flight", [0, None], ids=["window-2", "bulk"])
def test_two_peers_get_identical_batches_from_one_read(
    dask_client: Client, stream_plan: Path, loomtest: Any, bytes_in_flight: int | None
) -> None:
    meta = loomtest.Oracle(stream_plan).meta
    bound = {} if bytes_in_flight is None else {"bytes_in_flight": bytes_in_flight}
    with Executor(stream_plan, dask_client, constructors=2, window=2, peers=2, **bound) as ex:
        window = ex.window  # 2, or (bulk) as many steps as the default bytes bound holds
        a, b = StreamClient(stream_plan, 0), StreamClient(stream_plan, 0)
        got_a: list[Batch] = []
        got_b: list[Batch] = []
        for _ in range(meta.steps * meta.micro_batches):  # interleaved, as peers in one job would be
            got_a.append(next(a))
            got_b.append(next(b))
        a.close()
        b.close()
        m = _after_ahead_build(ex, ranks=[1], steps=min(window, meta.steps))
    for x, y in zip(got_a, got_b, strict=True):
        _same(x, y)
    man = read_manifest(stream_plan, meta)
    rank = man.column("dp_rank").to_numpy()
    step = man.column("step").to_numpy()
    # Rank 0 read once for both peers, plus rank 1's first window that its constructor built ahead.
    expected_segments = int(((rank == 0) | ((rank == 1) & (step < window))).sum())
    assert sum(lo.metrics.segments for lo in m.loaders) == expected_segments
    c0 = next(c for c in m.constructors if c.ranks == [0])
    assert c0.on_demand_steps == 0 and c0.built_steps == meta.steps
    assert c0.rank_takes[0] == 2 * meta.steps
    if bytes_in_flight is None:  # several steps per call
        assert window > 2 and a.calls < meta.steps and b.calls < meta.steps
    else:
        assert a.calls == b.calls == meta.steps


def test_client_continues_on_a_restarted_executor(dask_client: Client, stream_plan: Path, loomtest: Any) -> None:
    oracle = loomtest.Oracle(stream_plan)
    with StreamClient(stream_plan, 1, retry_s=30) as stream:
        with Executor(stream_plan, dask_client):
            before = [next(stream) for _ in range(4)]
        with Executor(stream_plan, dask_client):
            after = list(stream)
    got = before + after
    meta = oracle.meta
    assert [(b.step, b.micro_batch) for b in got] == [
        (s, m) for s in range(meta.steps) for m in range(meta.micro_batches)
    ]
    for b in got:
        oracle.check(b)


def test_verify_resume_at_every_position(dask_client: Client, stream_plan: Path) -> None:
    meta = read_plan(stream_plan)
    with Executor(stream_plan, dask_client):
        assert verify_resume(stream_plan, 1) == meta.steps * meta.micro_batches


def test_a_failed_connect_leaves_no_half_built_client(stream_plan: Path) -> None:
    """A Client whose constructor raised is collected at once, not later inside the next Client's start.

    Collected later, its `__del__` closes it while the retry's new Client starts its IO loop, and both wait
    on Dask's class-wide `LoopRunner` lock (seen as a hung suite in session 6).
    """
    import gc
    import socket

    from loomdata.execution import Timings

    with socket.socket() as s:  # a loopback port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stream = StreamClient(
        stream_plan, 0, f"tcp://127.0.0.1:{port}", insecure=True, timings=Timings(connect_timeout_s=2)
    )
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is Client}  # isinstance would touch proxies (torch warns)
    gc.disable()  # only what `_connect` itself collects is gone
    try:
        with pytest.raises((OSError, TimeoutError)) as raised:
            stream._connect()
        left = [o for o in gc.get_objects() if type(o) is Client and id(o) not in before]
    finally:
        gc.enable()
    assert left == []
    assert f"127.0.0.1:{port}" in str(raised.value)


def test_a_rank_restarted_from_an_earlier_step_is_served_from_builds_ahead(
    dask_client: Client, stream_plan: Path, loomtest: Any
) -> None:
    """A rank that starts again at an earlier step on a live executor (a resume from an older checkpoint): the same
    batches, built ahead in the moved-back window, not one on-demand build per take."""
    meta = loomtest.Oracle(stream_plan).meta
    with Executor(stream_plan, dask_client, window=2, bytes_in_flight=0) as ex:
        with StreamClient(stream_plan, 0) as first:
            got = list(first)
        start = 1
        with StreamClient(stream_plan, 0, start_step=start) as again:
            replay = list(again)
        c0 = next(c for c in ex.metrics().constructors if 0 in c.ranks)
    assert len(replay) == len(got) - start * meta.micro_batches
    for x, y in zip(got[start * meta.micro_batches :], replay, strict=True):
        _same(x, y)
    assert c0.on_demand_steps == 0 and c0.built_steps >= meta.steps + meta.steps - start

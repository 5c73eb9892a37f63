"""CP peers on a real cluster: each receives only its shard of a long-lane micro-batch, and the shards of
all peers reassemble to exactly what a whole (cp-less) read of the same rank gives, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata import reassemble_cp
from loomdata.client import StreamClient
from loomdata.execution import Executor
from loomdata.schemas import ExecutionError, cp_positions

CP = 4
LONG = 1024


def _same(a: Any, b: Any) -> None:
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.step, a.dp_rank, a.micro_batch, a.lane) == (b.step, b.dp_rank, b.micro_batch, b.lane)


def test_cp_peers_shards_reassemble_to_the_whole_read(
    dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any
) -> None:
    spec = loomtest.make_spec(
        tmp_path_factory.mktemp("cp"), steps=4, long_context={"threshold": 300, "seq_len": LONG, "cp_size": CP}
    )
    plan_dir = Path(loomtest.index_and_plan(spec, dask_client))
    oracle = loomtest.Oracle(plan_dir)
    meta = oracle.meta
    seen = {0: 0, 1: 0}
    tokens = 0
    # one whole reader and CP peers per dp rank: peers = 1 + CP takes release a held step
    with Executor(plan_dir, dask_client, peers=1 + CP) as ex:
        with pytest.raises(ExecutionError, match=rf"pass a cp rank in 0\.\.{CP - 1}"):
            StreamClient(plan_dir, 0, client=dask_client, cp_rank=CP)
        for r in range(meta.dp_size):
            whole = StreamClient(plan_dir, r, client=dask_client)
            peers = [StreamClient(plan_dir, r, client=dask_client, cp_rank=c) for c in range(CP)]
            for full, *shards in zip(whole, *peers, strict=True):
                tokens += oracle.check(full)  # the whole read is the manifest's tokens, read independently
                seen[full.lane] += 1
                if full.lane == 0:  # short lane (cp 1): every peer gets the whole micro-batch, as before
                    for s in shards:
                        assert s.positions is None and s.cp_size == 1
                        _same(full, s)
                    continue
                for c, s in enumerate(shards):  # long lane: only its shard crossed the wire
                    assert (s.cp_rank, s.cp_size, len(s.input_ids)) == (c, CP, LONG // CP)
                    assert s.positions is not None and np.array_equal(s.positions, cp_positions(LONG, CP, c))
                    assert np.array_equal(s.input_ids, full.input_ids[s.positions])
                back = reassemble_cp(shards)
                _same(full, back)
                assert back.num_tokens == full.num_tokens == sum(s.num_tokens for s in shards)
                assert np.array_equal(back.segment_ids(), full.segment_ids())
            for s in (whole, *peers):
                s.close()
        m = ex.metrics()
    built = sum(c.built_steps for c in m.constructors)
    on_demand = sum(c.on_demand_steps for c in m.constructors)
    assert built <= meta.steps * meta.dp_size and on_demand == 0  # held builds served the whole reader and all peers
    assert seen[1] > 0 and seen[0] > 0 and tokens > 0

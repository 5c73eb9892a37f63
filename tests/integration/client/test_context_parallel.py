"""CP peers on a real cluster: each receives only its shard of a long-lane micro-batch, and the shards of
all peers reassemble to exactly what a whole (cp-less) read of the same rank gives, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from distributed import Client

from loomdata import reassemble_cp
from loomdata.client import StreamClient
from loomdata.execution import Executor, ServeConfig
from loomdata.execution._config import SHARED_FLOOR_STEPS
from loomdata.execution._window import step_bytes
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import ExecutionError, cp_group_size, cp_positions, parse_spec, read_plan
from loomdata.testing import generate_corpus

CP = 4
LONG = 1024
DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


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
    bound = 64 * step_bytes(meta.seq_len, meta.micro_batches)  # 64 short steps; a step with a long lane is larger
    window = (
        ServeConfig(bytes_in_flight=bound)
        .for_plan(meta.seq_len, meta.micro_batches, meta.dp_size, long_seq_len=meta.long_seq_len)
        .window
    )
    assert Executor(plan_dir, dask_client, bytes_in_flight=bound).window == window < 64  # the Executor counts it
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


def test_every_format_with_images_under_two_cp_sizes(dask_client: Client, tmp_path: Path) -> None:
    """The demo corpus (text, long books, Megatron, image captions) with the short lane over cp 2 and a
    long lane over cp 4: every peer's shards reassemble to the whole read, images included."""
    generate_corpus(tmp_path / "data", "tiny", seed=0)
    raw = yaml.safe_load(DEMO.read_text().replace("../demo-work/data", str(tmp_path / "data")))
    raw["workdir"] = str(tmp_path / "work")
    raw["training"].update(steps=12, cp_size=2)
    raw["long_context"] = {"threshold": 2048, "seq_len": 8192, "cp_size": 4}
    spec = parse_spec(raw, tmp_path)
    build_index(spec, dask_client)
    plan_dir = make_plan(spec).plan_dir
    res_meta = read_plan(plan_dir)
    assert cp_group_size(res_meta) == 4
    lane_cp = {0: 2, 1: 4}
    images = cut = 0
    assert Executor(plan_dir, dask_client).window == SHARED_FLOOR_STEPS  # a plan with images: the bound before 21
    lanes = set()
    with Executor(plan_dir, dask_client, peers=1 + 4):
        for r in range(res_meta.dp_size):
            whole = StreamClient(plan_dir, r, client=dask_client)
            peers = [StreamClient(plan_dir, r, client=dask_client, cp_rank=c) for c in range(4)]
            for full, *got in zip(whole, *peers, strict=True):
                k = lane_cp[full.lane]
                lanes.add(full.lane)
                assert [s.cp_rank for s in got] == [c % k for c in range(4)] and {s.cp_size for s in got} == {k}
                shards = got[:k]  # peers c and c + k hold the same shard
                for c in range(k, 4):
                    _same(got[c], got[c % k])
                back = reassemble_cp(shards)
                _same(full, back)
                assert len(back.images) == len(full.images)
                assert all(np.array_equal(x, y) for x, y in zip(back.images, full.images, strict=True))
                images += len(full.images)
                cut += sum(len(s.images) for s in shards) - len(full.images)  # images held by two shards
            for s in (whole, *peers):
                s.close()
    assert lanes == {0, 1} and images > 0
    assert cut > 0  # some images straddle a chunk boundary (5 of 55 here): both shards hold them

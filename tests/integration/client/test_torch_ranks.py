"""A real 4-process torch.distributed (gloo) job consumes a running executor through LoomDataset."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from loomdata.execution import Executor
from loomdata.schemas import read_manifest, read_plan

WORLD = 4


@pytest.fixture(scope="module")
def plan4(dask_client: Client, tmp_path_factory: pytest.TempPathFactory, loomtest: Any) -> Path:
    spec = loomtest.make_spec(tmp_path_factory.mktemp("ranks4"), dp_size=WORLD, steps=4, micro_batches=2)
    return Path(loomtest.index_and_plan(spec, dask_client))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_four_gloo_ranks_each_get_their_exact_batches(dask_client: Client, plan4: Path, tmp_path: Path) -> None:
    meta = read_plan(plan4)
    script = Path(__file__).with_name("_rank_job.py")
    port = _free_port()
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    with Executor(plan4, dask_client, constructors=2):
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(plan4), str(r), str(WORLD), str(port), str(tmp_path / f"r{r}.json")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(WORLD)
        ]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    man = read_manifest(plan4, meta)
    lengths = man.column("length").to_numpy().astype(np.int64)
    ranks = man.column("dp_rank").to_numpy()
    for r, res in enumerate(results):
        assert res["batches"] == meta.steps * meta.micro_batches
        assert res["tokens"] == int(lengths[ranks == r].sum())
        assert res["ranks_seen"] == WORLD
        assert res["all_tokens"] == int(lengths.sum())
        assert res["state"]["step"] == meta.steps and res["state"]["micro_batch"] == 0

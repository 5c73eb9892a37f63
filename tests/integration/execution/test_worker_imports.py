"""What a serving worker loads: no `pyarrow.dataset` (manifest reads go through `pyarrow.parquet`), no pydantic (its
loaders and constructors read the plan as plain records), no fsspec where it serves local files (object URLs load it),
and one shared manifest span per process for all its loaders."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.schemas import read_plan


def _probe() -> Callable[[Any], dict[str, Any]]:
    """What a worker has loaded, as a nested function: pickled by value, so a worker does not import this test
    module (its imports, `Executor` among them, would load pydantic there)."""

    def loaded(dask_worker: Any) -> dict[str, Any]:
        from loomdata.execution import _manifest

        return {
            "dataset": "pyarrow.dataset" in sys.modules,
            "acero": "pyarrow._acero" in sys.modules,
            "fsspec": "fsspec" in sys.modules,
            "pydantic": sorted(
                m for m in ("pydantic", "loomdata.schemas.spec", "loomdata.schemas.plan") if m in sys.modules
            ),
            "spans": len(_manifest._SPANS),
            "loaders": sum(1 for k in dask_worker.state.actors if str(k).startswith("loom-loader")),
            "constructors": sum(1 for k in dask_worker.state.actors if "constructor" in str(k)),
        }

    return loaded


def test_serving_workers_import_no_pyarrow_dataset_pydantic_nor_fsspec_and_share_manifest_spans(
    stream_plan: Path, tmp_path: Path, loomtest: Any
) -> None:
    meta = read_plan(stream_plan)
    with open_cluster(n_workers=2, local_directory=tmp_path / "dask") as client, Executor(stream_plan, client):
        got = {}
        for r in range(meta.dp_size):
            with StreamClient(stream_plan, r) as stream:
                got[r] = list(stream)
        seen = list(client.run(_probe()).values())
    loomtest.check_exact(stream_plan, got)
    assert not any(w["dataset"] or w["acero"] for w in seen), seen
    # loaders and constructors read plan.json as records (`PlanView`): the pydantic spec never loads in a worker
    assert sum(w["constructors"] for w in seen) >= 1, seen
    assert all(not w["pydantic"] for w in seen), seen
    # local files need no fsspec: storage._fs imports it at the first object URL
    assert all(not w["fsspec"] for w in seen), seen
    # every loader of a worker plans from the same few spans, read once by that process
    assert sum(w["loaders"] for w in seen) >= 2
    assert all(w["spans"] <= 3 for w in seen), seen
    assert any(w["spans"] >= 1 for w in seen if w["loaders"]), seen


def test_read_table_and_read_manifest_load_no_pyarrow_dataset(tmp_path: Path) -> None:
    """What serving workers read (index with a shard filter, the manifest) loads neither `pyarrow.dataset` nor
    Arrow's scan threads: checked in a fresh interpreter."""
    import subprocess
    import sys

    import pyarrow as pa

    from loomdata.schemas import TableKind, write_table

    n = 200
    path = tmp_path / "samples.parquet"
    index = {"sample": pa.uint64(), "shard": pa.uint32(), "row": pa.uint64(), "num_tokens": pa.uint32()}
    cols = {"sample": range(n), "shard": [i // 50 for i in range(n)], "row": [i % 50 for i in range(n)]}
    cols |= {"num_tokens": [1] * n}
    table = pa.table({c: pa.array(cols[c], typ) for c, typ in index.items()})
    write_table(table.append_column("num_image_tokens", pa.array([0] * n, pa.uint32())), path, TableKind.INDEX)
    code = (
        "import sys\n"
        "from loomdata.schemas.tables import read_table, TableKind\n"
        f"t = read_table({str(path)!r}, TableKind.INDEX, columns=['sample'], filters=[('shard', '>=', 3)])\n"
        "assert t.column('sample').to_pylist() == list(range(150, 200)), t\n"
        "import loomdata.schemas.plan\n"
        "assert 'pyarrow.dataset' not in sys.modules and 'pyarrow._acero' not in sys.modules, 'dataset loaded'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plan_view_reads_what_read_plan_validates(stream_plan: Path, tmp_path: Path) -> None:
    """A worker's `PlanView` (plain JSON reading) is the view of the validated `PlanMeta` of the same plan.json, for
    the real plan and for one with every field the view reads away from its default."""
    import dataclasses
    import json

    import pytest

    from loomdata.execution._plan_meta import shared_plan
    from loomdata.schemas.errors import ContractError
    from loomdata.schemas.plan_view import read_plan_view
    from loomdata.schemas.records import CostBalance, OnError, TokenizerKind, VerifyMode

    assert read_plan_view(stream_plan) == read_plan(stream_plan).view()
    assert shared_plan(stream_plan) is shared_plan(stream_plan)

    raw = json.loads((stream_plan / "plan.json").read_text())
    raw["spec"]["tokenizer"] = {"kind": "huggingface", "path": str(tmp_path / "tok.json"), "pad_token_id": 3}
    raw["spec"]["images"] = {"patch_size": 16, "max_pixels": 4096, "placeholder_token_id": 7}
    src = raw["spec"]["sources"][0]
    src |= {"metadata": ["a", "b"], "on_error": "skip", "verify": "shard", "image_field": ["png"]}
    raw["parameters"]["cost"] = {"attention": 2.0, "linear": 5.0, "balance": "both", "encoder": 0.5}
    raw["parameters"]["short_cp_size"] = 2
    raw |= {"long_seq_len": 64, "long_cp_size": 4}
    other = tmp_path / "other"
    other.mkdir()
    (other / "plan.json").write_text(json.dumps(raw))
    view = read_plan_view(other)
    assert view == read_plan(other).view()
    assert view.spec.tokenizer.kind is TokenizerKind.HUGGINGFACE and view.spec.images.patch_size == 16
    first = view.spec.source(src["name"])
    assert (first.on_error, first.verify, first.metadata) == (OnError.SKIP, VerifyMode.SHARD, ("a", "b"))
    assert view.parameters.cost.balance is CostBalance.BOTH and view.lane_seq_len(1) == 64
    assert dataclasses.astuple(view.parameters)[1] == 2

    del raw["manifest"]
    (other / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(ContractError, match=r"invalid plan\.json.*manifest"):
        read_plan_view(other)


def test_serving_process_imports_no_pydantic_and_checks_the_plan_in_a_child(stream_plan: Path, tmp_path: Path) -> None:
    """The serving process (an embedded cluster and an Executor, as `loom serve` runs them) validates plan.json in a
    child interpreter and reads it as a `PlanView`: pydantic and the spec and plan models never load in it (fresh
    interpreter; test_plan_check.py checks the child's answers)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from loomdata.execution import Executor, open_cluster\n"
        f"with open_cluster(n_workers=1, local_directory={str(tmp_path / 'dask')!r}) as client:\n"
        f"    with Executor({str(stream_plan)!r}, client) as ex:\n"
        "        assert ex.info is not None and ex.peers >= 1\n"
        "        print(ex.meta.plan_id, [m for m in ('pydantic', 'loomdata.schemas.spec', 'loomdata.schemas.plan')"
        " if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=300, capture_output=True, text=True)
    assert out.stdout.split()[-1] == "[]", out.stdout
    assert out.stdout.split()[0] == read_plan(stream_plan).plan_id, out.stdout

"""The serving process's plan check (`_plan_meta.check_plan`): plan.json, the spec or storage options it is served
with and the index's build settings, validated in a child interpreter whose errors are raised in the caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from loomdata.cli import main
from loomdata.execution._plan_meta import check_plan
from loomdata.schemas import ContractError
from loomdata.schemas.plan import PlanMeta, read_plan
from loomtest.plancheck import plan_meta

SECRET = "loomINTEGRATIONsecret0123456789"
OPTIONS = {"s3": {"endpoint_url": "http://127.0.0.1:9", "key": "keyid", "secret": SECRET}}


def _raw(steps: int = 1) -> dict[str, Any]:
    """The spec `plan_meta` plans from (one Parquet source `web`), with storage options at the top level."""
    return {
        "name": "t",
        "workdir": ".",
        "storage_options": OPTIONS,
        "sources": [{"name": "web", "format": "parquet", "paths": ["x"], "tokens_field": "ids"}],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 8, "steps": steps, "dp_size": 1, "micro_batches": 1},
    }


def _plan_dir(tmp: Path, meta: PlanMeta) -> Path:
    d = tmp / "plans" / meta.plan_id
    d.mkdir(parents=True)
    (d / "plan.json").write_text(meta.to_json())
    return d


def test_loom_serve_refuses_a_spec_file_that_is_not_the_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the lock and the cluster: one message, exit 2, no secret (the child's ContractError, raised here)."""
    plan_dir = _plan_dir(tmp_path, plan_meta())
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(_raw(steps=9)))
    assert main(["serve", str(plan_dir), "--spec", str(spec_file)]) == 2
    err = capsys.readouterr().err
    assert f"spec {spec_file} is not the spec plan p was made from" in err and "plan.json" in err, err
    assert SECRET not in err
    assert not (plan_dir / "serve.json").exists() and not (plan_dir / "serve.lock").exists()


def test_check_plan_gives_the_view_options_and_peers_and_raises_the_childs_errors(
    stream_plan: Path, tmp_path: Path
) -> None:
    checked = check_plan(stream_plan)
    meta = read_plan(stream_plan)
    t = meta.spec.training
    assert checked.view == meta.view() and not checked.options
    assert checked.peers == t.tp_size * t.pp_size * t.cp_size
    src = meta.sources[0]
    opts = check_plan(stream_plan, storage_options={src: OPTIONS}).options  # back by value, shown redacted
    assert opts.of(src) == OPTIONS and SECRET not in repr(opts)
    with pytest.raises(ValueError, match=r"storage_options name sources plan .* does not have: .*nowhere"):
        check_plan(stream_plan, storage_options={"nowhere": {"s3": {"key": "x"}}})
    with pytest.raises(ContractError, match=r"plan\.json"):
        check_plan(tmp_path / "no-plan")


def test_the_child_ignores_the_working_directory_and_stray_output(
    stream_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `pickle.py` in the working directory is not imported by the child (it would see the storage options and
    write the answer the caller unpickles), and a line printed at start-up (a sitecustomize) is not the answer."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "pickle.py").write_text("raise SystemExit('the working directory was imported')\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('hello from sitecustomize')\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("PYTHONPATH", str(site))
    checked = check_plan(stream_plan)
    assert checked.view == read_plan(stream_plan).view() and checked.plan_dir == stream_plan.resolve()
    with pytest.raises(ContractError, match=r"plan\.json"):  # the child's error still comes back by class
        check_plan(tmp_path / "no-plan")


def test_an_executor_refuses_the_check_of_another_plan(stream_plan: Path, tmp_path: Path) -> None:
    from loomdata.execution import Executor

    other = tmp_path / "other"
    other.mkdir()
    (other / "plan.json").write_bytes((stream_plan / "plan.json").read_bytes())
    with pytest.raises(ValueError, match="is the check of"):
        Executor(other, client=None, checked=check_plan(stream_plan))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        Executor(stream_plan, client=None, checked=check_plan(stream_plan), storage_options={})  # type: ignore[arg-type]


def test_the_child_refuses_another_loomdata_first_on_its_path(
    stream_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `loomdata` ahead of this one on PYTHONPATH is not what checks the plan (it would see the options)."""
    from loomdata.schemas import ExecutionError

    fake = tmp_path / "fake"
    (fake / "loomdata").mkdir(parents=True)
    (fake / "loomdata" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    with pytest.raises(ExecutionError, match="imported loomdata from"):
        check_plan(stream_plan)

"""Storage options for serving: taken from the plan's own spec only, shown redacted, carried by value.

The integration test `tests/integration/storage/test_s3_spec_options.py` serves with them end to end;
`tests/integration/execution/test_plan_check.py` has `loom serve` refuse another spec (a child interpreter checks).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from loomdata.execution._storage_options import SourceOptions, serving_options
from loomdata.schemas import ContractError, Spec, parse_spec
from loomtest.plancheck import plan_meta

SECRET = "loomUNITsecret0123456789"
OPTIONS = {"s3": {"endpoint_url": "http://127.0.0.1:9", "key": "keyid", "secret": SECRET}}


def _raw(steps: int = 1, workdir: str = ".") -> dict[str, Any]:
    """The spec `plan_meta` plans from (one Parquet source `web`), with storage options at the top level."""
    return {
        "name": "t",
        "workdir": workdir,
        "storage_options": OPTIONS,
        "sources": [{"name": "web", "format": "parquet", "paths": ["x"], "tokens_field": "ids"}],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 8, "steps": steps, "dp_size": 1, "micro_batches": 1},
    }


def _spec(tmp: Path, **kw: Any) -> Spec:
    return parse_spec(_raw(**kw), tmp, check_paths=False)


def test_the_plans_own_spec_gives_its_options_wherever_it_lives(tmp_path: Path) -> None:
    meta = plan_meta()
    spec = _spec(tmp_path / "elsewhere", workdir="/some/other/workdir")  # locations are not the plan's
    assert spec.spec_hash() != meta.spec.spec_hash() and spec.content_hash() == meta.spec.content_hash()
    opts = serving_options(meta, spec=spec)
    assert opts.of("web") == OPTIONS and opts.sources == ["web"]
    served = opts.source_spec(meta.spec.source("web"))
    assert served.storage_options == OPTIONS and meta.spec.source("web").storage_options == {}
    assert SECRET not in served.model_dump_json() and SECRET not in repr(served)


def test_another_spec_is_refused_naming_both(tmp_path: Path) -> None:
    meta = plan_meta()
    other = _spec(tmp_path, steps=7)
    with pytest.raises(ContractError) as err:
        serving_options(meta, spec=other, plan_dir=tmp_path / "plan")
    msg = str(err.value)
    for part in (other.content_hash(), meta.spec.content_hash(), f"{tmp_path / 'plan'}/plan.json", meta.plan_id):
        assert part in msg, (part, msg)
    assert SECRET not in msg


def test_a_mapping_must_name_the_plans_sources(tmp_path: Path) -> None:
    meta = plan_meta()
    assert serving_options(meta, storage_options={"web": OPTIONS}).of("web") == OPTIONS
    with pytest.raises(ValueError, match=r"does not have: \['books'\]; it has \['web'\]") as err:
        serving_options(meta, storage_options={"books": OPTIONS})
    assert SECRET not in str(err.value)
    with pytest.raises(ValueError, match=r"storage_options\['web'\]: expected a mapping") as err:
        serving_options(meta, storage_options={"web": {"s3": SECRET}})  # type: ignore[dict-item]
    assert SECRET not in str(err.value)
    with pytest.raises(ValueError, match="not both"):
        serving_options(meta, spec=_spec(tmp_path), storage_options={"web": OPTIONS})
    assert not serving_options(meta)


def test_options_show_redacted_and_travel_by_value() -> None:
    opts = SourceOptions({"web": OPTIONS, "books": {"s3": {"secret": "other"}}})
    for shown in (repr(opts), str(opts), f"{opts}", repr([opts])):
        assert SECRET not in shown and "***" in shown and "http://127.0.0.1:9" in shown, shown
    back = pickle.loads(pickle.dumps(opts))
    assert back.of("web") == OPTIONS and back.of("books") == {"s3": {"secret": "other"}}
    one = opts.only("web")
    assert one.sources == ["web"] and "other" not in pickle.dumps(one).decode("latin-1")
    copy = opts.of("web")
    copy["s3"]["secret"] = "changed"
    assert opts.of("web") == OPTIONS  # callers get copies

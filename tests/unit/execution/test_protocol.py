"""serve.json: round trip, version check, rank lookup, and the missing-executor message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomdata.execution.protocol import (
    ConstructorInfo,
    ServeInfo,
    parse_serve_info,
    read_serve_info,
    write_serve_info,
)
from loomdata.schemas import ContractError, ExecutionError


def _info() -> ServeInfo:
    return ServeInfo(
        plan_id="p1",
        scheduler="tcp://127.0.0.1:1",
        window=2,
        peers=1,
        constructors=[
            ConstructorInfo(name="c0", ranks=[0, 1], worker="w0"),
            ConstructorInfo(name="c1", ranks=[2], worker="w1"),
        ],
        loaders=[],
        pid=1,
        started_at=0.0,
    )


def test_round_trip_and_rank_lookup(tmp_path: Path) -> None:
    write_serve_info(tmp_path, _info())
    info = read_serve_info(tmp_path)
    assert info == _info()
    assert info.constructor_for(2).name == "c1"
    with pytest.raises(ExecutionError, match="no constructor serves dp rank 3"):
        info.constructor_for(3)


def test_missing_and_wrong_version(tmp_path: Path) -> None:
    with pytest.raises(ExecutionError, match="loom serve"):
        read_serve_info(tmp_path)
    raw = {**_info().model_dump(mode="json"), "format_version": 7}
    with pytest.raises(ContractError, match="version 7 is not supported"):
        parse_serve_info(json.dumps(raw), "x")


def test_the_light_constructor_handle_names_every_public_constructor_method() -> None:
    import inspect

    from loomdata.execution._constructor import DataConstructor
    from loomdata.execution.protocol import ConstructorCalls

    def public(cls: type) -> set[str]:
        return {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}

    assert public(ConstructorCalls) == public(DataConstructor)

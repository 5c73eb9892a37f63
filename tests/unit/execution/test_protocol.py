"""serve.json: round trip, version check, rank lookup, and the missing-executor message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomdata.execution.protocol import (
    SERVE_FORMAT_VERSION,
    ConstructorInfo,
    LocalGateway,
    ServeInfo,
    host_id,
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


def test_a_local_gateway_round_trips_and_an_older_reader_is_told_to_upgrade(tmp_path: Path) -> None:
    """serve.json format 4 names a gateway's Unix socket; a format-3 reader (strict about fields) refuses by version."""
    local = LocalGateway(path="/tmp/loom-gw-x/gateway.sock", host_id=host_id())
    c = ConstructorInfo(name="c0", ranks=[0], worker="w0", gateway="tls://127.0.0.1:2", gateway_id="ab", local=local)
    info = _info().model_copy(update={"constructors": [c]})
    write_serve_info(tmp_path, info)
    assert read_serve_info(tmp_path).constructor_for(0).local == local
    assert SERVE_FORMAT_VERSION == 4 and json.loads((tmp_path / "serve.json").read_text())["format_version"] == 4
    old = {**info.model_dump(mode="json"), "format_version": 3}
    with pytest.raises(ContractError, match=r"version 3 is not supported .* reads version 4"):
        parse_serve_info(json.dumps(old), "x")
    assert host_id() == host_id() and "/" in host_id()


def test_the_light_constructor_handle_names_every_public_constructor_method() -> None:
    import inspect

    from loomdata.execution._constructor import DataConstructor
    from loomdata.execution.protocol import ConstructorCalls

    def public(cls: type) -> set[str]:
        return {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}

    assert public(ConstructorCalls) == public(DataConstructor)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": 1}, "unknown field\\(s\\) 'extra'"),
        ({"window": "2"}, "ServeInfo.window: expected int, got str"),
        ({"peers": True}, "ServeInfo.peers: expected int, got bool"),
        ({"constructors": [{"name": "c0", "ranks": ["0"], "worker": "w0"}]}, "constructors\\[0\\].ranks\\[0\\]"),
        ({"constructors": [{"name": "c0", "worker": "w0"}]}, "missing field\\(s\\) 'ranks'"),
        ({"tls": {"ca_file": "a", "cert": "b"}}, "ServeInfo.tls: missing field\\(s\\) 'key'"),
    ],
)
def test_a_serve_json_that_does_not_match_its_fields_is_refused_naming_the_field(
    change: dict[str, object], message: str
) -> None:
    raw = {**_info().model_dump(mode="json"), **change}
    with pytest.raises(ContractError, match=message):
        parse_serve_info(json.dumps(raw), "serve.json")


def test_records_validate_when_built_and_copy_with_updates() -> None:
    from loomdata.execution._record import RecordError
    from loomdata.execution.protocol import ServeLock, TlsInfo

    with pytest.raises(RecordError, match=r"ConstructorInfo\.gateway: expected str, got int"):
        ConstructorInfo(name="c", ranks=[0], worker="w", gateway=1)  # type: ignore[arg-type]
    info = _info().model_copy(update={"heartbeat_at": 5, "tls": TlsInfo(ca_file="a", cert="b", key="c")})
    assert info.heartbeat_at == 5.0 and isinstance(info.heartbeat_at, float)  # an int is taken as a float
    assert ServeInfo.model_validate_json(json.dumps(info.model_dump(mode="json"))) == info
    with pytest.raises(RecordError, match="expected int, got str"):
        _info().model_copy(update={"pid": "1"})
    lock = ServeLock(pid=3, host="h", started_at=1.5)
    assert ServeLock.model_validate_json(lock.model_dump_json()) == lock
    with pytest.raises(ValueError, match="not valid JSON"):  # callers catch ValueError, as with pydantic
        ServeLock.model_validate_json("{")

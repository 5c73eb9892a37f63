"""Which S3 reads go through pyarrow, with which arguments, and how its errors are classified (no network)."""

from __future__ import annotations

import pytest

from loomdata.storage import ErrorKind, classify
from loomdata.storage._arrow import TRANSPORT_ENV, arrow_s3_kwargs


def test_s3fs_style_options_become_pyarrow_arguments() -> None:
    opts = {
        "key": "K",
        "secret": "S",
        "token": "T",
        "client_kwargs": {"endpoint_url": "http://h:9", "region_name": "r"},
    }
    assert arrow_s3_kwargs(opts, env={}) == {
        "access_key": "K",
        "secret_key": "S",
        "session_token": "T",
        "endpoint_override": "http://h:9",
        "region": "r",
    }
    assert arrow_s3_kwargs({"anon": True, "endpoint_url": "http://e"}, env={}) == {
        "anonymous": True,
        "endpoint_override": "http://e",
    }


def test_the_endpoint_comes_from_the_environment_which_pyarrow_ignores() -> None:
    assert arrow_s3_kwargs({}, env={"AWS_ENDPOINT_URL": "http://a"}) == {"endpoint_override": "http://a"}
    env = {"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://s3only"}
    assert arrow_s3_kwargs({}, env=env) == {"endpoint_override": "http://s3only"}
    assert arrow_s3_kwargs({"endpoint_url": "http://opt"}, env=env) == {"endpoint_override": "http://opt"}
    assert arrow_s3_kwargs({}, env={}) == {}


@pytest.mark.parametrize(
    "opts", [{"requester_pays": True}, {"config_kwargs": {"max_pool_connections": 4}}, {"client_kwargs": {"verify": 0}}]
)
def test_options_only_s3fs_knows_keep_s3fs(opts: dict[str, object]) -> None:
    assert arrow_s3_kwargs(opts, env={}) is None


def test_the_environment_can_turn_pyarrow_off() -> None:
    assert arrow_s3_kwargs({}, env={TRANSPORT_ENV: "fsspec"}) is None
    assert arrow_s3_kwargs({}, env={TRANSPORT_ENV: "arrow"}) == {}


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("When reading 'k' in bucket 'b': AWS Error NETWORK_CONNECTION during GetObject: curlCode: 56", "transient"),
        ("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.", "transient"),
        ("AWS Error SERVICE_UNAVAILABLE during GetObject operation", "transient"),
        ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", "denied"),
        ("AWS Error NO_SUCH_BUCKET during HeadObject operation", "not_found"),
        ("AWS Error UNKNOWN during GetObject operation", "other"),
        ("a plain OSError", "other"),
    ],
)
def test_pyarrow_s3_errors_are_classified_by_their_aws_error(message: str, kind: str) -> None:
    assert classify(OSError(message)) is ErrorKind(kind)

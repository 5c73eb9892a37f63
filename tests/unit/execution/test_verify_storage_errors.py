"""A store's refusal while serving keeps its class and gets its own fix; only a real difference says "changed"."""

from __future__ import annotations

import pickle

import pytest

from loomdata.execution._verify import (
    ACCESS_HINT,
    MISSING_HINT,
    SERVING_HINT,
    TRANSIENT_HINT,
    serving_error,
    storage_error,
)
from loomdata.schemas import SourceDataError
from loomdata.storage import AccessDeniedError, ObjectNotFoundError, StorageError, TransientStorageError

URL = "s3://bkt/web/part-0.parquet"
SECRET = "s3cr3t-value-never-shown"
OPTIONS = {"s3": {"endpoint_url": "http://127.0.0.1:9000", "key": "AKIAEXAMPLE", "secret": SECRET}}


@pytest.mark.parametrize(
    ("error", "hint", "words"),
    [
        (AccessDeniedError(URL, "stat: no credentials found (NoCredentialsError: x)"), ACCESS_HINT, "no credentials"),
        (ObjectNotFoundError(URL, "stat: no such bucket or object (x)"), MISSING_HINT, "is missing now"),
        (TransientStorageError(URL, "stat failed 6 times, the last with x"), TRANSIENT_HINT, "failed 6 times"),
    ],
)
def test_a_refusal_at_the_shard_check_keeps_its_class_and_names_shard_and_source(
    error: StorageError, hint: str, words: str
) -> None:
    got = storage_error(error, "shard 3 of source 'web'", OPTIONS, indexed=1234)
    msg = str(got)
    assert type(got) is type(error) and got.url == URL and got.hint == hint
    assert msg.startswith(f"{URL}: shard 3 of source 'web': ") and words in msg, msg
    assert "changed after indexing" not in msg and SECRET not in msg and "AKIAEXAMPLE" not in msg, msg
    assert str(pickle.loads(pickle.dumps(got))) == msg  # crosses the actor boundary intact


def test_access_denied_says_which_options_the_loader_had_redacted() -> None:
    error = AccessDeniedError(URL, "stat: access denied (PermissionError: Forbidden)")
    given = str(storage_error(error, "shard 0 of source 'web'", OPTIONS))
    assert "'endpoint_url': 'http://127.0.0.1:9000'" in given and "'secret': '***'" in given and SECRET not in given
    assert "was given no storage_options" in str(storage_error(error, "shard 0 of source 'web'", None))


def test_a_hint_of_the_errors_own_is_kept() -> None:
    error = ObjectNotFoundError(URL, "no filesystem for s3:// (x)", hint="pip install 'loomdata[s3]'")
    assert storage_error(error, "shard 0 of source 'web'").hint == "pip install 'loomdata[s3]'"


def test_a_read_refused_while_serving_names_the_source_and_keeps_its_class() -> None:
    got = serving_error(URL, ObjectNotFoundError(URL, "read of bytes 0..10: no such bucket or object (x)"), "web")
    assert isinstance(got, ObjectNotFoundError) and "source 'web'" in str(got) and got.hint == MISSING_HINT
    denied = serving_error(URL, AccessDeniedError(URL, "read of bytes 0..10: access denied (x)"), "web", OPTIONS)
    assert isinstance(denied, AccessDeniedError) and denied.hint == ACCESS_HINT and SECRET not in str(denied)


def test_other_read_errors_keep_the_serving_hint() -> None:
    got = serving_error(URL, SourceDataError(URL, "not a readable Parquet file (x)"), "web")
    assert type(got) is SourceDataError and got.hint == SERVING_HINT
    assert serving_error("/data/a.jsonl", FileNotFoundError(2, "No such file or directory")).hint == SERVING_HINT

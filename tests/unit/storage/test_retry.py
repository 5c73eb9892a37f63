"""Retry classification and the back-off loop: transient errors are retried, the rest name the URL at once."""

from __future__ import annotations

import pickle

import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from loomdata.schemas import SourceDataError
from loomdata.storage import (
    AccessDeniedError,
    ErrorKind,
    ObjectNotFoundError,
    RetryPolicy,
    StorageError,
    TransientStorageError,
    classify,
    retrying,
)

URL = "s3://bkt/web/part-0.parquet"


def _client_error(code: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def _wrapped(inner: BaseException) -> OSError:
    """What s3fs raises: an OSError whose cause is botocore's error."""
    try:
        raise inner
    except BaseException as e:
        try:
            raise OSError(5, "wrapped") from e
        except OSError as outer:
            return outer


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (_client_error("SlowDown", 503), ErrorKind.TRANSIENT),
        (_client_error("InternalError", 500), ErrorKind.TRANSIENT),
        (_client_error("503", 503), ErrorKind.TRANSIENT),
        (_client_error("ThrottlingException"), ErrorKind.TRANSIENT),
        (ConnectionResetError(104, "Connection reset by peer"), ErrorKind.TRANSIENT),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), ErrorKind.TRANSIENT),
        (ReadTimeoutError(endpoint_url="http://x"), ErrorKind.TRANSIENT),
        (TimeoutError(), ErrorKind.TRANSIENT),
        (_client_error("NoSuchKey", 404), ErrorKind.NOT_FOUND),
        (_client_error("NoSuchBucket", 404), ErrorKind.NOT_FOUND),
        (FileNotFoundError("bkt/x"), ErrorKind.NOT_FOUND),
        (_client_error("AccessDenied", 403), ErrorKind.DENIED),
        (_client_error("InvalidAccessKeyId", 403), ErrorKind.DENIED),
        (PermissionError("no"), ErrorKind.DENIED),
        (ValueError("parse"), ErrorKind.OTHER),
        (_wrapped(_client_error("SlowDown", 503)), ErrorKind.TRANSIENT),
        (_wrapped(ConnectionResetError()), ErrorKind.TRANSIENT),
        (_wrapped(_client_error("NoSuchKey", 404)), ErrorKind.NOT_FOUND),
    ],
)
def test_classify(error: BaseException, kind: ErrorKind) -> None:
    assert classify(error) is kind


_NOW = RetryPolicy(attempts=4, base_s=0.0, max_s=0.0)  # no waiting in unit tests


def test_transient_errors_are_retried_until_success() -> None:
    calls: list[int] = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "Connection reset by peer")
        return b"ok"

    seen: list[BaseException] = []
    assert retrying(flaky, URL, "read", _NOW, on_retry=seen.append) == b"ok"
    assert len(calls) == 3 and len(seen) == 2


def test_persistent_transient_errors_end_as_a_transient_storage_error_naming_the_url() -> None:
    calls: list[int] = []

    def always() -> None:
        calls.append(1)
        raise _client_error("SlowDown", 503)

    with pytest.raises(TransientStorageError, match=r"s3://bkt/web/part-0\.parquet: read failed 4 times.*SlowDown"):
        retrying(always, URL, "read", _NOW)
    assert len(calls) == 4


@pytest.mark.parametrize(
    ("error", "cls", "words"),
    [
        (_client_error("NoSuchBucket", 404), ObjectNotFoundError, "no such bucket or object"),
        (_client_error("AccessDenied", 403), AccessDeniedError, "access denied"),
        (ValueError("odd"), StorageError, "failed"),
    ],
)
def test_permanent_errors_are_not_retried(error: BaseException, cls: type[StorageError], words: str) -> None:
    calls: list[int] = []

    def fail() -> None:
        calls.append(1)
        raise error

    with pytest.raises(cls, match=words) as got:
        retrying(fail, URL, "stat", _NOW)
    assert len(calls) == 1 and got.value.url == URL and URL in str(got.value)
    assert isinstance(got.value, SourceDataError)  # the index job's on_error and the serving hints apply


def test_storage_errors_pickle_with_their_class_url_and_hint() -> None:
    e = AccessDeniedError(URL, "stat: access denied")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is AccessDeniedError and back.url == URL and str(back) == str(e)


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="bad retry policy"):
        RetryPolicy(attempts=0)
    assert 0 <= RetryPolicy(base_s=0.1, max_s=1.0).delay(10) <= 1.0


def test_no_credentials_is_access_denied_saying_so() -> None:
    """botocore raises NoCredentialsError before sending anything: not a generic failure, not retried."""
    for error in (
        NoCredentialsError(),
        _wrapped(NoCredentialsError()),
        PartialCredentialsError(provider="env", cred_var="x"),
    ):
        assert classify(error) is ErrorKind.DENIED
    calls: list[int] = []

    def fail() -> None:
        calls.append(1)
        raise NoCredentialsError()

    with pytest.raises(AccessDeniedError, match=r"stat: no credentials found \(NoCredentialsError") as got:
        retrying(fail, URL, "stat", _NOW)
    assert len(calls) == 1 and "--spec SPEC.yaml" in str(got.value)


def test_refused_credentials_say_so() -> None:
    def fail() -> None:
        raise _wrapped(_client_error("SignatureDoesNotMatch", 403))

    with pytest.raises(AccessDeniedError, match="access denied: the store refused the credentials"):
        retrying(fail, URL, "get", _NOW)

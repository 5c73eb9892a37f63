"""Which storage errors are worth retrying, and a retry loop with exponential back-off.

Throttling (429, SlowDown), 5xx, timeouts and dropped connections are transient: retried with
back-off. A missing bucket or object and a refused credential are not: they become
`ObjectNotFoundError` / `AccessDeniedError` naming the URL at once. No credentials at all (botocore's
`NoCredentialsError`, raised before any request is sent) is an `AccessDeniedError` too, saying so, never a
generic failure: the fix is the same (credentials in the environment or the source's `storage_options`).
The classifier walks the exception
chain (`__cause__`, `__context__`), so it sees botocore's, aiohttp's and fsspec's errors alike without
importing any of them.
"""

from __future__ import annotations

import enum
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from loomdata.storage._errors import AccessDeniedError, ObjectNotFoundError, StorageError, TransientStorageError

__all__ = ["ErrorKind", "RetryPolicy", "classify", "retrying"]

T = TypeVar("T")


class ErrorKind(str, enum.Enum):
    """What a storage exception means for the caller."""

    TRANSIENT = "transient"
    NOT_FOUND = "not_found"
    DENIED = "denied"
    OTHER = "other"


_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"})
_INVALID_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException", "InvalidToken",
        "InvalidClientTokenId", "UnrecognizedClientException", "TokenRefreshRequired",
    }
)  # fmt: skip
_DENIED_CODES = _INVALID_CREDENTIAL_CODES | {"AccessDenied", "403", "401", "Forbidden", "AllAccessDisabled"}
_NO_CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError"})  # botocore, before any request
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests", "429",
        "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
        "500", "502", "503", "504",
    }
)  # fmt: skip
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
        "ServerDisconnectedError", "ClientPayloadError", "ClientOSError", "ClientConnectionError",
        "IncompleteRead", "ResponseStreamingError", "ProtocolError", "ServerTimeoutError",
    }
)  # fmt: skip


# pyarrow's S3 client raises plain OSErrors whose text names the AWS SDK's error ("AWS Error SLOW_DOWN during ...")
_ARROW_ERROR = re.compile(r"AWS Error ([A-Z_]+)")
_ARROW_KINDS = {
    "NO_SUCH_KEY": "not_found", "NO_SUCH_BUCKET": "not_found", "RESOURCE_NOT_FOUND": "not_found",
    "ACCESS_DENIED": "denied", "INVALID_ACCESS_KEY_ID": "denied", "SIGNATURE_DOES_NOT_MATCH": "denied",
    "MISSING_AUTHENTICATION_TOKEN": "denied", "INVALID_CLIENT_TOKEN_ID": "denied", "UNRECOGNIZED_CLIENT": "denied",
    "NETWORK_CONNECTION": "transient", "SLOW_DOWN": "transient", "THROTTLING": "transient",
    "SERVICE_UNAVAILABLE": "transient", "INTERNAL_FAILURE": "transient", "REQUEST_TIMEOUT": "transient",
    "REQUEST_TIME_TOO_SKEWED": "transient",
}  # fmt: skip


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _code_of(e: BaseException) -> str | None:
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return str(code) if code is not None else None


def _kind_of_one(e: BaseException) -> ErrorKind | None:
    if type(e).__name__ in _NO_CREDENTIAL_NAMES:
        return ErrorKind.DENIED
    code = _code_of(e)
    status = getattr(e, "status", None) or getattr(e, "code", None)
    for c in (code, str(status) if isinstance(status, int) else None):
        if c in _NOT_FOUND_CODES:
            return ErrorKind.NOT_FOUND
        if c in _DENIED_CODES:
            return ErrorKind.DENIED
        if c in _TRANSIENT_CODES or (c is not None and c.isdigit() and 500 <= int(c) < 600):
            return ErrorKind.TRANSIENT
    if isinstance(e, FileNotFoundError):
        return ErrorKind.NOT_FOUND
    arrow = _ARROW_ERROR.search(str(e)) if type(e) is OSError else None
    if arrow is not None and arrow.group(1) in _ARROW_KINDS:
        return ErrorKind(_ARROW_KINDS[arrow.group(1)])
    if isinstance(e, PermissionError):
        return ErrorKind.DENIED
    if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _TRANSIENT_NAMES:
        return ErrorKind.TRANSIENT
    return None


def classify(e: BaseException) -> ErrorKind:
    """The kind of a storage exception: the first specific kind found along its chain."""
    for link in _chain(e):
        kind = _kind_of_one(link)
        if kind is not None:
            return kind
    return ErrorKind.OTHER


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently transient errors are retried: `base_s * 2**i`, capped, with jitter."""

    attempts: int = 6
    base_s: float = 0.05
    max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError(f"bad retry policy {self}: need attempts >= 1 and 0 <= base_s <= max_s")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (0-based): full jitter over the capped exponential."""
        return random.uniform(0, min(self.max_s, self.base_s * 2**attempt))


DEFAULT_POLICY = RetryPolicy()


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _denied(e: BaseException) -> str:
    """What a DENIED error says: no credentials found, credentials refused as invalid, or access denied."""
    chain = list(_chain(e))
    if any(type(link).__name__ in _NO_CREDENTIAL_NAMES for link in chain):
        return "no credentials found"
    if any(_code_of(link) in _INVALID_CREDENTIAL_CODES for link in chain):
        return "access denied: the store refused the credentials (invalid or expired key, secret or token)"
    return "access denied"


def retrying(
    fn: Callable[[], T],
    url: str,
    what: str,
    policy: RetryPolicy = DEFAULT_POLICY,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """`fn()`, retried on transient errors; every failure ends as a StorageError naming `url`."""
    for attempt in range(policy.attempts):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:
            kind = classify(e)
            if kind is ErrorKind.NOT_FOUND:
                raise ObjectNotFoundError(url, f"{what}: no such bucket or object ({_short(e)})") from None
            if kind is ErrorKind.DENIED:
                raise AccessDeniedError(url, f"{what}: {_denied(e)} ({_short(e)})") from None
            if kind is ErrorKind.OTHER:
                raise StorageError(url, f"{what} failed ({_short(e)})") from None
            if attempt + 1 == policy.attempts:
                raise TransientStorageError(
                    url, f"{what} failed {policy.attempts} times, the last with {_short(e)}"
                ) from None
            if on_retry is not None:
                on_retry(e)
            time.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")  # the loop returns or raises

"""Where source files live: local paths (plain `open`/mmap) or object URLs (s3://, gs://, https://) via fsspec.

One small API for readers and the index job: `location` and `is_url` tell the two apart, `glob`,
`identity` (size + ETag/version, or the file's stat), `open_input` / `ObjectView` / `read_range` read
(`read_range_identity`: an S3 range and the object's identity from the one GET's response, no HEAD;
`head_identity`: an S3 object's identity from the HEAD that opens its pyarrow read handle, kept for its large reads,
where `handle_opened` says its reads take one)
(`open_ahead` opens an object's read handle before its first large read; `warm_client` makes a store's
client before its first request)
(`request_latency`: the median of a store's recent range GETs, for sizing read-ahead),
`fetch_to_cache` keeps a small object on local disk (large S3 ranges go through pyarrow's S3 client:
`LOOMDATA_S3_TRANSPORT=fsspec` keeps them on s3fs). Transient errors are retried with back-off
(`RetryPolicy`); the rest raise a `StorageError` naming the URL. `storage_options` are never
written: `redact` hides their secrets wherever they are shown.
"""

from loomdata.storage._errors import AccessDeniedError, ObjectNotFoundError, StorageError, TransientStorageError
from loomdata.storage._fs import (
    ObjectIdentity,
    ObjectView,
    RangeFile,
    StorageOptions,
    cache_dir,
    exists,
    fetch_to_cache,
    glob,
    handle_opened,
    head_identity,
    identity,
    open_ahead,
    open_input,
    read_range,
    read_range_identity,
    request_stats,
    reset_request_stats,
    warm_client,
)
from loomdata.storage._latency import request_latency, reset_request_latency, store_of
from loomdata.storage._options import REDACTED, options_for, redact
from loomdata.storage._retry import ErrorKind, RetryPolicy, classify, retrying
from loomdata.storage._url import REMOTE_PROTOCOLS, Location, is_url, location, protocol_of, suffix_of

__all__ = [
    "REDACTED",
    "REMOTE_PROTOCOLS",
    "AccessDeniedError",
    "ErrorKind",
    "Location",
    "ObjectIdentity",
    "ObjectNotFoundError",
    "ObjectView",
    "RangeFile",
    "RetryPolicy",
    "StorageError",
    "StorageOptions",
    "TransientStorageError",
    "cache_dir",
    "classify",
    "exists",
    "fetch_to_cache",
    "glob",
    "handle_opened",
    "head_identity",
    "identity",
    "is_url",
    "location",
    "open_ahead",
    "open_input",
    "options_for",
    "protocol_of",
    "read_range",
    "read_range_identity",
    "redact",
    "request_latency",
    "request_stats",
    "reset_request_latency",
    "reset_request_stats",
    "retrying",
    "store_of",
    "suffix_of",
    "warm_client",
]

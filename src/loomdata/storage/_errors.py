"""Object-storage errors: each names the URL and says what to do; all are SourceDataErrors (bad input)."""

from __future__ import annotations

from loomdata.schemas.errors import SourceDataError

__all__ = ["AccessDeniedError", "ObjectNotFoundError", "StorageError", "TransientStorageError"]


class StorageError(SourceDataError):
    """A read or listing of an object failed; `path` is the URL."""

    default_hint = "check the URL, the credentials and the store's status"

    def __init__(self, url: str, message: str, hint: str | None = None) -> None:
        super().__init__(url, message, hint=hint or self.default_hint)

    @property
    def url(self) -> str:
        return self.path

    def __reduce__(self) -> tuple[type[StorageError], tuple[str, str, str | None]]:  # type: ignore[override]
        """Pickle by constructor arguments (the error crosses Dask task and actor boundaries)."""
        return (type(self), (self.path, self.reason, self.hint))


class ObjectNotFoundError(StorageError):
    """The bucket or the object does not exist."""

    default_hint = "fix `paths` (bucket and key) or restore the object; then re-run `loom index`"


class AccessDeniedError(StorageError):
    """The store refused the credentials in use, or none were found."""

    default_hint = (
        "use credentials that can read it: for S3 AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE in the "
        "environment of every process that reads, or the source's `storage_options` in the spec (serving takes "
        "those only from `loom serve PLAN_DIR --spec SPEC.yaml`)"
    )


class TransientStorageError(StorageError):
    """Throttling, a dropped connection or a 5xx that persisted through every retry."""

    default_hint = (
        "the store kept failing through every retry with back-off: check its status and the network, then try again"
    )

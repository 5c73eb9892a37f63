"""A Source Loader's checks of what it reads against the index: the shard when opened, every sample read.

`verify: sample` (the default) checks both; `shard` only the shard: its size, mtime and content
fingerprint as `shards.parquet` recorded them, once per shard per loader; `off` nothing. A difference
is a SourceDataError naming the file (and the sample), with the fix for serving: the file changed after
indexing, so re-run `loom index` and `loom plan`. Read errors of a shard that passed the open check
(deleted or truncated while serving) get the same hint instead of the index job's `on_error: skip`.

A check or read that the store refuses is not a change: the error says what went wrong, naming the URL,
the shard and the source (`storage_error`), and keeps its class (`storage._errors`):
- `AccessDeniedError`, no credentials or refused ones: the loader's credentials cannot read what the index
  read; the fix is credentials for the workers (their environment, or `loom serve --spec SPEC.yaml` so the
  spec's `storage_options` reach the loaders), never a re-index. It says whether the loader was given
  options, shown through `redact` (never a secret);
- `ObjectNotFoundError`: the object or its bucket is missing now: restore it, or re-index;
- `TransientStorageError`: throttling, 5xx or dropped connections through every retry with back-off (its
  reason gives the attempts and the last error): the store's status, not the data.

A planned loader holds the checksums of the samples its plan reads next only (`_sample_index.HeldChecksums`);
those it reads again from samples.parquet must come from the index it started with: one rebuilt since is refused
with `index_changed` (a StaleIndexError naming the source and the file), never compared against.

Sample checks need the index's checksums to be of this loomdata's definition (`sources._integrity.CHECKSUM`,
recorded in samples.parquet's metadata): `require_checksums` refuses an index of another definition, or of
none recorded (built before it was), with "re-run `loom index` and `loom plan`", never a false "file changed".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas.errors import ContractError, SourceDataError, StaleIndexError
from loomdata.schemas.layout import ObjectMemo
from loomdata.schemas.records import SourceFormat, VerifyMode
from loomdata.schemas.tables import CHECKSUM_FIELD
from loomdata.sources import Sample
from loomdata.sources._integrity import (
    CHECKSUM,
    TOKEN_DTYPE,
    checksums,
    head_checked,
    stat_shard,
    unchanged_object,
)
from loomdata.storage import (
    AccessDeniedError,
    Location,
    ObjectNotFoundError,
    StorageError,
    StorageOptions,
    TransientStorageError,
    redact,
)

__all__ = [
    "ACCESS_HINT",
    "CHECKSUM_KEY",
    "INDEX_CHANGED_HINT",
    "MISSING_HINT",
    "SERVING_HINT",
    "TRANSIENT_HINT",
    "ShardCheck",
    "Verifier",
    "index_changed",
    "require_checksums",
    "serving_error",
    "storage_error",
]

SERVING_HINT = "the file changed after indexing: re-run `loom index` and `loom plan`"
ACCESS_HINT = (
    "the loaders' credentials cannot read what the index read: give the workers credentials for the store "
    "(for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE in their environment), or serve with the "
    "spec that holds them, `loom serve PLAN_DIR --spec SPEC.yaml` (Python: `Executor(..., spec=...)`), so its "
    "`storage_options` reach the loaders; the index needs no rebuild"
)
MISSING_HINT = "restore the object (or its bucket), or re-run `loom index` and `loom plan` on what the store holds now"
TRANSIENT_HINT = (
    "the store kept failing through every retry with back-off: check its status and the workers' network to it, "
    "then serve again; the index needs no rebuild"
)
INDEX_CHANGED_HINT = (
    "re-plan with `loom plan SPEC` and restart `loom serve` (its loaders verify against the index they started with)"
)
CHECKSUM_KEY = b"loomdata.checksum"
"""samples.parquet metadata key naming the index's checksum definition (written by `indexing._assemble`)."""


def require_checksums(samples: Path, source: str) -> None:
    """Refuse an index whose per-sample checksums are missing or of another definition than `CHECKSUM`."""
    schema = pq.read_schema(str(samples))
    if CHECKSUM_FIELD.name not in schema.names:
        raise ContractError(
            f"{samples}: the index of source {source!r} has no per-sample checksums to verify reads against; "
            "re-run `loom index` and `loom plan` (or set `verify: shard` on the source)"
        )
    got = (schema.metadata or {}).get(CHECKSUM_KEY, b"").decode()
    if got != CHECKSUM:
        what = f"checksums of definition {got!r}" if got else "checksums of no recorded definition (an older loomdata)"
        raise ContractError(
            f"{samples}: the index of source {source!r} holds {what}, this loomdata verifies {CHECKSUM!r}; "
            "re-run `loom index` and `loom plan` (or set `verify: shard` on the source)"
        )


def index_changed(samples: Path | str, source: str, why: str) -> StaleIndexError:
    """A loader reading its sample checksums again found `samples` (the index) other than when it started."""
    return StaleIndexError(
        f"source {source!r}: {samples}: index changed since `loom serve` started ({why}); no sample is checked "
        f"against another index than the plan's: {INDEX_CHANGED_HINT}"
    )


@dataclass(frozen=True, slots=True)
class ShardCheck:
    """What the index recorded of one shard."""

    size_bytes: int
    mtime_ns: int
    fingerprint: str


def _given(options: StorageOptions | None) -> str:
    """What storage options a loader was given, secrets redacted (never a value of a secret-looking key)."""
    if not options:
        return "the loader was given no storage_options: it used its worker's environment"
    return f"the loader's storage_options: {redact(options)}"


def storage_error(
    error: StorageError, where: str, options: StorageOptions | None = None, indexed: int | None = None
) -> StorageError:
    """A store's refusal while serving (`where`: the shard and source), of the same class, with the serving fix.

    A hint of the error's own (not its class's default, e.g. the client to install) is kept.
    """
    own = error.hint != type(error).default_hint
    if isinstance(error, AccessDeniedError):
        return AccessDeniedError(
            error.url, f"{where}: {error.reason}; {_given(options)}", error.hint if own else ACCESS_HINT
        )
    if isinstance(error, ObjectNotFoundError):
        was = f"it was indexed ({indexed} bytes)" if indexed is not None else "it was indexed"
        reason = f"{where}: {error.reason}: {was} and is missing now"
        return ObjectNotFoundError(error.url, reason, error.hint if own else MISSING_HINT)
    if isinstance(error, TransientStorageError):
        return TransientStorageError(error.url, f"{where}: {error.reason}", error.hint if own else TRANSIENT_HINT)
    return type(error)(error.url, f"{where}: {error.reason}", error.hint)


def serving_error(
    path: Path | str, error: BaseException, source: str | None = None, options: StorageOptions | None = None
) -> SourceDataError:
    """A read failure while serving, as a SourceDataError with the serving hint.

    The index job's hints (`on_error: skip`, re-run `loom index` alone) do not fit a file that failed after
    it was indexed; a reader's own specific hint (fix the tokenized data) is kept. A store's refusal (a
    `StorageError`) keeps its class and gets its own fix (`storage_error`), naming `source`.
    """
    if isinstance(error, StorageError):
        return storage_error(error, f"source {source!r}" if source is not None else "while serving", options)
    if isinstance(error, SourceDataError):
        if error.hint is not None and "loom index" not in error.hint:
            return error
        return SourceDataError(error.path, error.reason, row=error.row, hint=SERVING_HINT)
    why = getattr(error, "strerror", None) or str(error)
    return SourceDataError(str(path), f"cannot read the file while serving ({why})", hint=SERVING_HINT)


@dataclass(slots=True)
class Verifier:
    """Checks shards on first use and samples on every read, per the source's `verify` mode.

    Thread-safe shard checks: a loader checks its shards ahead in the background (`_shard_opens`) while
    its reads may meet the same shard; a check asked while another thread runs it waits for that one
    instead of repeating its requests (and runs its own only if that one failed, to report the error).
    """

    source: str
    mode: VerifyMode
    fmt: SourceFormat
    shards: dict[int, ShardCheck]
    options: StorageOptions | None = None  # the source's `storage_options`: its checks reach the store its reads do
    versions: dict[int, str] = field(default_factory=dict)  # objects' whole ETag/version the index recorded, by shard
    opened: set[int] = field(default_factory=set)
    _checking: dict[int, threading.Event] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(
        cls,
        source: str,
        mode: VerifyMode,
        fmt: SourceFormat,
        table: pa.Table,
        first: int,
        stop: int,
        options: StorageOptions | None = None,
    ) -> Verifier:
        """A verifier of shards [first, stop) of a shards table (SHARDS_SCHEMA), on the source's `options`."""
        ids = table.column("shard").to_pylist()
        size = table.column("size_bytes").to_pylist()
        mtime = table.column("mtime_ns").to_pylist()
        fp = table.column("fingerprint").to_pylist()
        shards = {
            int(i): ShardCheck(int(s), int(m), str(f))
            for i, s, m, f in zip(ids, size, mtime, fp, strict=True)
            if first <= i < stop
        }
        return cls(source, mode, fmt, shards, options)

    def hold_versions(self, memo: Mapping[str, ObjectMemo], paths: Mapping[int, Location]) -> None:
        """Keep each object shard's whole ETag/version from the index's memo (by URL), where the memo's size and
        fingerprint are the shards table's: the one-request check (`unchanged_object`) compares it exactly."""
        for shard, path in paths.items():
            want, got = self.shards.get(shard), memo.get(str(path))
            if (
                want is not None
                and got is not None
                and (got.size, got.fingerprint) == (want.size_bytes, want.fingerprint)
            ):
                self.versions[shard] = got.version

    def opens_handle(self, shard: int, path: Location) -> bool:
        """Whether checking `shard` opens its read handle: a one-object s3:// shard whose size, stamp and ETag/version
        the index recorded, read through a pyarrow handle, is checked from the HEAD that opens it (`unchanged_object`;
        `head_checked` is its own test): not opened again."""
        want = self.shards.get(shard)
        if self.mode is VerifyMode.OFF or want is None:
            return False
        return head_checked(path, self.fmt, self.options, want.size_bytes, want.mtime_ns, self.versions.get(shard))

    @property
    def samples(self) -> bool:
        """Whether every sample read is checked (its checksum is needed)."""
        return self.mode is VerifyMode.SAMPLE

    def open_shard(self, shard: int, path: Location) -> None:
        """Check a shard against the index the first time this loader reads it (once, whichever thread asks)."""
        if self.mode is VerifyMode.OFF or shard in self.opened:
            return
        with self._lock:
            if shard in self.opened:
                return
            ours = shard not in self._checking
            event = self._checking.setdefault(shard, threading.Event())
        if not ours:  # another thread checks it now: its answer is this one's
            event.wait()
            if shard not in self.opened:
                self._check(shard, path)  # that check failed: this one reports the error
            return
        try:
            self._check(shard, path)
        finally:
            with self._lock:
                del self._checking[shard]
            event.set()

    def _check(self, shard: int, path: Location) -> None:
        want = self.shards[shard]
        try:
            version = self.versions.get(shard)
            if unchanged_object(path, self.fmt, self.options, want.size_bytes, want.mtime_ns, version):  # S3: 1 request
                self.opened.add(shard)
                return
            # an object: its edges read beside its HEAD
            got = stat_shard(path, self.fmt, self.options, size=want.size_bytes)
        except StorageError as e:  # the store refused: not a change (credentials, a missing object, retries out)
            where = f"shard {shard} of source {self.source!r}"
            raise storage_error(e, where, self.options, want.size_bytes) from None
        except SourceDataError as e:
            raise SourceDataError(
                e.path,
                f"{e.reason}: it was indexed ({want.size_bytes} bytes) but is gone or unreadable now",
                hint=SERVING_HINT,
            ) from None
        diffs = []
        if got.size_bytes != want.size_bytes:
            diffs.append(f"size {got.size_bytes} bytes, indexed {want.size_bytes}")
        if got.mtime_ns != want.mtime_ns:  # an object's mtime_ns is a stamp of its ETag/version
            what = "ETag/version changed" if got.version else f"mtime {got.mtime_ns} ns, indexed {want.mtime_ns}"
            diffs.append(what)
        if got.fingerprint != want.fingerprint:
            diffs.append("content fingerprint differs")
        if diffs:
            raise SourceDataError(
                str(path), f"shard {shard} of source {self.source!r}: " + "; ".join(diffs), hint=SERVING_HINT
            )
        self.opened.add(shard)

    def check_samples(
        self,
        path: Location,
        rows: np.ndarray,
        samples: np.ndarray,
        expected: np.ndarray,
        read: list[Sample],
        dtype: np.dtype = TOKEN_DTYPE,
    ) -> None:
        """Compare the checksums of `read` (the samples at `rows`) with the index's `expected` ones.

        `dtype` is the checksum dtype of the shard read (`FormatReader.checksum_dtype`)."""
        got = checksums([s.tokens for s in read], dtype)
        if (got != expected).any():  # the lengths only name the sample in the error
            lengths = np.fromiter((len(s.tokens) for s in read), dtype=np.int64, count=len(read))
            self.compare(path, rows, samples, lengths, got, expected)

    def compare(
        self,
        path: Location,
        rows: np.ndarray,
        samples: np.ndarray,
        lengths: np.ndarray,
        got: np.ndarray,
        expected: np.ndarray,
    ) -> None:
        """SourceDataError naming the first of `samples` (at `rows` of `path`, `lengths` tokens) whose checksum `got`
        is not the index's `expected`; nothing when all agree."""
        bad = np.flatnonzero(got != expected)
        if len(bad):
            i = int(bad[0])
            raise SourceDataError(
                str(path),
                f"sample {int(samples[i])} of source {self.source!r}: its {int(lengths[i])} tokens have checksum "
                f"{int(got[i]):08x}, the index recorded {int(expected[i]):08x} "
                f"({len(bad)} of {len(got)} samples read differ)",
                row=int(rows[i]),
                hint=SERVING_HINT,
            )

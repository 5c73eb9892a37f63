"""The protocol every source format implements: list shards, scan lengths, read samples by location.

A format reader knows nothing of Dask, plans or ranks. The index job calls `num_parts` and `scan`
(one task per part of a shard); Source Loader actors call `read` with the `row` values the scan
produced; a path is a `Location` (a local `Path`, or an object URL string read through
`loomdata.storage`). One reader instance may keep file state (open handles, Parquet metadata, decompressed
blocks) between calls; it is created where it is used, never pickled with that state.

Threads: a reader whose `thread_safe` is False (the default) may be called from one thread at a time
only; whoever shares it across threads (a Source Loader reads small requests on its event loop and
large ones in a thread) must serialise its calls. A reader that sets `thread_safe = True` guards its
own state and may be called concurrently.

Read units: a format whose reads decode whole blocks (Parquet row groups) says which block each row
lives in (`units`) and keeps decoded blocks in its `unit_cache`, keyed `(str(path), unit)`. The cache
belongs to whoever drives the reads: by default a small LRU; a Source Loader sets its own
(`use_unit_cache`), which knows from the plan which blocks a pending step still needs (a hint the
reader cannot have) and keeps each only until its last use. Such a cache may also name the rows of a
unit it will still ask for (`wanted`): the reader then keeps only those (`KeptRows`), not the whole
decoded block. `load_unit` decodes one unit outside any cache, so a second reader can read units ahead
and offer them to the same cache. Such a format counts the units it decodes (`decoded`, a `DecodeCounts` its
`sibling`s share): what a Source Loader decoded, against what it served.
"""

from __future__ import annotations

import abc
import collections
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pyarrow as pa

from loomdata.schemas.formats import check_fields
from loomdata.sources._integrity import TOKEN_DTYPE
from loomdata.storage import Location

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = ["DecodeCounts", "FormatReader", "KeptRows", "LruUnitCache", "Sample", "ScanResult", "UnitCache", "UnitKey"]

UnitKey = tuple[str, int]
"""A read unit's cache key: (str(path), unit)."""

DEFAULT_UNIT_CACHE_BYTES = 32 * 1024 * 1024
"""Decoded read units a reader keeps by default (no owner set a cache): a few neighbouring blocks."""


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Lengths of the samples of one part of one shard.

    `rows` has columns `row: uint64` (the location `read` takes), `num_tokens: uint32`,
    `num_image_tokens: uint32`, `checksum: uint32` (of the token stream `read` returns, hashed in
    `checksum_dtype(path)`, see `sources._integrity`), then the source's metadata columns, in shard order.
    `errors` lists skipped samples as (row or None, message); only non-empty with `on_error: skip`.
    """

    rows: pa.Table
    errors: list[tuple[int | None, str]] = field(default_factory=list)


class DecodeCounts:
    """Read units decoded by a reader and its siblings (a loader's read-ahead readers), each decode counted (again
    when a unit is decoded again), with the rows (samples) and token ids they hold: a Source Loader reports them beside
    what it served (`LoaderMetrics.tokens_decoded`), so tokens decoded and never served show. Counted per unit, never
    per sample. `tokens` is None once a unit whose tokens are not ids was decoded (a text column: tokenized per row
    read). Thread-safe: siblings decode on several threads."""

    __slots__ = ("_lock", "rows", "tokens", "units")

    def __init__(self) -> None:
        self.units = 0
        self.rows = 0
        self.tokens: int | None = 0
        self._lock = threading.Lock()

    def add(self, rows: int, tokens: int | None) -> None:
        """One unit decoded: `rows` rows holding `tokens` token ids (None: not token ids)."""
        with self._lock:
            self.units += 1
            self.rows += rows
            self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens

    def snapshot(self) -> tuple[int, int, int | None]:
        """(units, rows, tokens) as one state (a decode on another thread may be counting)."""
        with self._lock:
            return self.units, self.rows, self.tokens


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample's token stream (image placeholder tokens first, then text) and its decoded images."""

    tokens: np.ndarray  # int32, len == num_tokens of the index
    images: list[np.ndarray] = field(default_factory=list)  # HWC uint8, resized per ImageSpec


@dataclass(frozen=True, slots=True)
class TokenSpans:
    """Where the tokens of some rows lie, not copied: row `i` is `buffers[buffer[i]][start[i]:stop[i]]` (int32 ids;
    a buffer is int32, or uint16 where a unit was kept narrow: widen where copying out, hash as int32).

    `FormatReader.token_spans` answers it so a loader can cut, join and checksum a whole request's segments
    in a few calls instead of one `Sample` (and several NumPy calls) per row. `unit`: each row's read unit
    (row group), as `units` tells it. Buffers are read-only views into decoded units: copy out, never write.
    """

    buffers: list[np.ndarray]
    buffer: np.ndarray  # int64 per row
    start: np.ndarray  # int64 per row
    stop: np.ndarray  # int64 per row
    unit: np.ndarray  # int64 per row


class UnitCache(Protocol):
    """Decoded read units between reads; `key` is `(str(path), unit)`. Must be safe to call from several threads."""

    def get(self, key: UnitKey) -> Any | None:
        """The unit kept under `key`, or None."""

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        """Offer a freshly decoded unit of `nbytes`; the cache decides whether (and how long) to keep it."""

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        """The rows of unit `key` (sorted `row` values) later reads will ask for; None: keep the whole unit."""


@dataclass(frozen=True, slots=True)
class KeptRows:
    """Some rows of a decoded unit, as a reader keeps them when its cache names the rows it wants.

    `rows`: the kept `row` values (sorted, unique); `values`: the decoded rows, in that order.
    """

    rows: np.ndarray
    values: Any


class LruUnitCache:
    """The default `UnitCache`: the most recently used units up to `max_bytes` (at least the last one)."""

    def __init__(self, max_bytes: int = DEFAULT_UNIT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"LruUnitCache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: collections.OrderedDict[UnitKey, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: UnitKey) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: UnitKey, value: Any, nbytes: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes += nbytes - (old[1] if old else 0)
            self._items[key] = (value, nbytes)
            while self.nbytes > self.max_bytes and len(self._items) > 1:
                _, (_, n) = self._items.popitem(last=False)
                self.nbytes -= n

    def wanted(self, key: UnitKey) -> np.ndarray | None:
        """Unknown here: whole units are kept."""
        return None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0


class FormatReader(abc.ABC):
    """Scans and reads one source's shards; subclasses implement one on-disk format."""

    thread_safe: ClassVar[bool] = False
    """Whether `scan`/`read`/`close` may run in several threads at once (else callers serialise them)."""

    def __init__(self, source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> None:
        check_fields(source)  # the format's field rules (`FIELD_RULES`), the same ones the spec is checked by
        self.source = source
        self.tokenizer_spec = tokenizer
        self.images = images
        self.unit_cache: UnitCache = LruUnitCache()
        self.decoded: DecodeCounts | None = None  # a format with read units counts its decodes (shared by siblings)

    def use_unit_cache(self, cache: UnitCache) -> None:
        """Keep decoded read units in `cache` from now on (its owner decides what stays)."""
        self.unit_cache = cache

    def units(self, path: Location, rows: np.ndarray) -> np.ndarray | None:
        """The read unit (e.g. row group, int64) each of `rows` lives in, a search of `unit_starts` (an empty unit is
        passed over; rows out of range map to -1: `read` reports them); None: this format has no units to cache."""
        starts = self.unit_starts(path)
        if starts is None:
            return None
        rows = np.asarray(rows, dtype=np.int64)
        g = np.searchsorted(starts, rows, side="right") - 1
        return np.where((rows >= 0) & (rows < starts[-1]), g, -1).astype(np.int64)

    def unit_starts(self, path: Location) -> np.ndarray | None:
        """The first row of each read unit of `path` and its row count at the end (int64, ascending), opening no
        file; None: this format has no units to cache. The one place a format tells its units (`units` and the
        loaders' planning, `_plan_ahead.UnitTable`, search it)."""
        return None

    def load_unit(self, path: Location, unit: int, rows: np.ndarray | None = None) -> tuple[Any, int] | None:
        """Decode read unit `unit` of `path` without touching the unit cache: (value, nbytes) as `read` would keep it.

        `rows`: keep only these rows of it (a `KeptRows`; None: the whole unit). For a read ahead (a Source
        Loader's prefetch) in a reader of its own; None: no units in this format.
        """
        return None

    def unit_span(self, path: Location, unit: int) -> tuple[int, int] | None:
        """The bytes [start, stop) of object `path` reading unit `unit` fetches; None: not a range read (a local
        file, no units), so there is nothing to coalesce."""
        return None

    def load_units(
        self, path: Location, units: Sequence[int], rows: Sequence[np.ndarray | None]
    ) -> list[tuple[Any, int] | None]:
        """`load_unit` of each of `units` (with its `rows`); a reader of ranges fetches their bytes in one request."""
        return [self.load_unit(path, u, r) for u, r in zip(units, rows, strict=True)]

    @abc.abstractmethod
    def num_parts(self, path: Location, target_bytes: int) -> int:
        """How many independently scannable parts `path` splits into (row groups, byte ranges), >= 1."""

    @abc.abstractmethod
    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        """Lengths of the samples in part `part` of `num_parts` of `path`.

        Raises SourceDataError (naming file and row) on bad input when the source's on_error is
        `error`; with `skip`, bad samples are left out of `rows` and listed in `errors`.
        """

    @abc.abstractmethod
    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        """The samples at `rows` (values of the scan's `row` column) of `path`, in the order given."""

    def token_spans(self, path: Location, rows: np.ndarray) -> TokenSpans | None:
        """The tokens of `rows` (ascending, distinct) of `path` as spans of int32 buffers (or uint16 where a unit was
        kept narrow: see `TokenSpans`), not copied; None: this
        format or file cannot (the caller uses `read`). Same errors as `read`; no images (a format with images
        returns None)."""
        return None

    def prepare(self, path: Location, size: int | None = None) -> None:  # noqa: B027 - optional hook
        """Fetch and keep what opening `path` needs (a Parquet footer), for this reader and its `sibling`s.

        `size`: the shard's size in bytes as indexed, where known (an object's footer then needs no HEAD).
        Thread-safe, unlike `read`: a Source Loader opens its shards' objects concurrently at serve start
        so that no read waits on those requests in turn. Default: nothing to fetch ahead.
        """

    def layout_of(self, path: Location) -> bytes | None:
        """What opening object `path` reads before its data (a Parquet footer), as bytes for the index to keep
        (`layouts.parquet`), so a loader opens it with no such read; None: a local file, or nothing to keep."""
        return None

    def hold_layouts(self, layouts: Mapping[str, tuple[int, bytes]]) -> None:  # noqa: B027 - optional hook
        """Take objects' layouts as the index kept them (`layout_of`; URL -> (indexed size, layout)): `prepare` then
        reads nothing for them. Their content is checked as always (the shard check before a read uses any byte)."""

    def sibling(self) -> FormatReader:
        """A new reader of the same source that shares what `prepare` fetched (for a loader's read-ahead threads)."""
        return type(self)(self.source, self.tokenizer_spec, self.images)

    def checksum_dtype(self, path: Location) -> np.dtype:
        """The dtype `path`'s samples are checksummed in: how the shard stores its ids (default int32).

        The scan hashes the stored ids in it; verification casts the int32 tokens `read` returns to it.
        """
        return TOKEN_DTYPE

    def close(self) -> None:  # noqa: B027 - optional hook; readers without state have nothing to release
        """Release open files and caches (a cache set by `use_unit_cache` is its owner's to clear)."""

"""Parquet sources: a pre-tokenized list column (`tokens_field`) or a raw text column (`text_field`).

Parts are contiguous groups of row groups of about `target_bytes` each; `row` is the row number
inside the file. Counting is columnar: list lengths come from `list_value_length`, text counts from
the tokenizer's batch count. `read` maps rows to row groups with a binary search, reads only those
row groups (only the content column) and keeps decoded row groups in its `unit_cache` (a row group
is a read unit, `units`): by default a small LRU; a Source Loader's cache keeps a row group exactly
while a pending step of the plan still needs it, and names the rows it will still ask for
(`UnitCache.wanted`): then only those rows are kept (`KeptRows`, a `take` of the decoded group), which
under a shuffle is a small part of it. Files open with `pre_buffer=False`: pre-buffering keeps every
open file's raw column chunks, which a cache of decoded row groups makes redundant. A `list<int32>` column
(without nulls) is read without copying: each row's tokens are a read-only view into the decoded group that
holds it (`_token_views`; its caller copies the segments it needs out); other integer types go through a
`take` and are checked and converted to int32.

Narrow units: a kept unit (whole or `KeptRows`) of a `list<int32>` column without nulls whose every id is in
[0, 65535], and of which fewer than `_NARROW_SHARE` of the rows are wanted, is kept with uint16 values on the same
offsets (`_narrowed`: one OR-reduction over its values, one Arrow cast), half the bytes in the cache and in its
accounting (GPT-2's and Llama-2's vocabularies fit). Tokens still leave as int32: `read` widens a narrow unit's rows,
`token_spans` hands its uint16 buffers to the loader, which widens them where it copies the segments out and hashes
the samples it checks as int32 (the column's type). A unit most of whose rows are read stays int32 (as does one kept
with no rows named, the default LRU cache's): every read would pay the widening (narrowing every unit measured
0.81-0.90x the stream benchmark's tokens per CPU-second against it off, session 19, inside that sitting's spread of
0.82-1.09x), while sparsely read units of many sources are what fills a worker (300 sources: 20 against 28-32 MiB a
worker at first coverage).

A file's footer is read and parsed once (`FileLayouts`: its schema check and row-group bounds, and the
footer itself kept serialized: 2.6 KB where parsed it is ~25 KiB), shared by a reader and its `sibling`s
(a loader's planning and read-ahead readers); each reader opens its own handle from that footer (parsed
again, no read of the file), and `units` opens none. At most `OPEN_FILES` files are open per process
(`_open_files`): 300 sources of 4 shards on one worker held 1,200 open, 34 MiB of parsed footers.
An object URL is opened as a range-reading file (`loomdata.storage.RangeFile`): the footer and each row
group's column chunks are range GETs; its size and footer are fetched once (`prepare`, or the first
open), so a reader opening an object whose layout is held makes no request. Given the size the index
recorded (`prepare(path, size)`: a loader's shard opens), the footer is one range GET and no HEAD; an
object of another size now (rewritten since indexing) fails that read and is HEADed and read afresh. Given the
footer the index kept (`layouts.parquet`, `sources._layouts`; a loader's `hold_layouts`), opening the object makes
no request at all: its first row-group GET goes out at once (the shard check, which every read waits for before it
uses a byte, still refuses an object rewritten since).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.records import OnError
from loomdata.sources._base import (
    DecodeCounts,
    FormatReader,
    KeptRows,
    LruUnitCache,
    Sample,
    ScanResult,
    TokenSpans,
    UnitKey,
)
from loomdata.sources._integrity import checksums_flat
from loomdata.sources._open_files import OpenFiles, new_owner
from loomdata.sources.tokenizer import Tokenizer, make_tokenizer
from loomdata.storage import Location, RangeFile, StorageOptions, identity, is_url

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = ["ParquetReader"]

_INT32_MAX = np.iinfo(np.int32).max
_NARROW_MAX = np.iinfo(np.uint16).max  # a unit whose ids all fit [0, this] is kept as uint16 (`_narrowed`)
_WHOLE_SHARE = 1 / 16  # a row group of which at least this share of rows is wanted is kept whole
_NARROW_SHARE = 1 / 2  # a kept unit of which fewer rows are wanted is held narrow where its ids fit (`_narrowed`)


@dataclass(frozen=True, slots=True)
class _Layout:
    """What a Parquet file's footer says, read once: the footer serialized, the schema, where its row groups start."""

    footer: bytes  # the file's metadata as a Parquet metadata file (parsed again for each open)
    schema: pa.Schema
    size: int | None  # an object's size (URLs); None for a local file
    rg_starts: np.ndarray  # int64, first row of each row group, plus the total at the end
    rg_bytes: np.ndarray  # int64, uncompressed bytes per row group
    leaves: tuple[str, ...]  # the top-level column of each leaf column (Parquet's column chunks)
    chunks: np.ndarray  # int64 (row groups, leaves, 2): each column chunk's byte range [start, stop) in the file

    @property
    def num_rows(self) -> int:
        return int(self.rg_starts[-1])

    def span(self, column: str, g: int) -> tuple[int, int]:
        """The bytes [start, stop) reading column `column` of row group `g` fetches (its leaves' chunks)."""
        cols = [i for i, name in enumerate(self.leaves) if name == column]
        part = self.chunks[g, cols]
        return int(part[:, 0].min()), int(part[:, 1].max())

    def metadata(self) -> pq.FileMetaData:
        """The footer parsed (~25 KiB held while the file is open; about 0.03 ms)."""
        return pq.read_metadata(pa.BufferReader(self.footer))


@dataclass(frozen=True, slots=True)
class _FileInfo:
    """An open Parquet file (a reader's own handle), its shared layout and, for a URL, its range-reading file."""

    file: pq.ParquetFile
    layout: _Layout
    handle: BinaryIO | None = None

    def close(self) -> None:
        self.file.close()
        if self.handle is not None:
            self.handle.close()

    @property
    def rg_starts(self) -> np.ndarray:
        return self.layout.rg_starts

    @property
    def rg_bytes(self) -> np.ndarray:
        return self.layout.rg_bytes

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows


class FileLayouts:
    """Each file's `_Layout` (for a URL: HEAD + footer GETs), read once for all readers sharing this store.

    Thread-safe: concurrent asks for one path wait for a single read; a failed read is not kept (the
    next ask tries again and raises the real error). `check` validates a new layout's schema first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Layout] = {}
        self._reading: dict[str, threading.Lock] = {}
        self._known: dict[str, tuple[int, bytes]] = {}  # URL -> (indexed size, footer) the index kept, not parsed yet

    def hold(self, layouts: Mapping[str, tuple[int, bytes]]) -> None:
        """Objects' footers as the index kept them (URL -> (indexed size, serialized footer)): parsed when first
        asked for, with no request (an unparsable one is read from the object instead)."""
        with self._lock:
            self._known.update(layouts)

    def peek(self, path: Location) -> _Layout | None:
        """`path`'s layout if held (never a request)."""
        with self._lock:
            return self._held.get(str(path))

    def get(
        self,
        path: Location,
        options: StorageOptions | None,
        check: Callable[[pa.Schema], None],
        size: int | None = None,
    ) -> _Layout:
        """`path`'s layout, read now if not held (`size`: the object's size as indexed, where known: no HEAD)."""
        key = str(path)
        with self._lock:
            hit = self._held.get(key)
            if hit is not None:
                return hit
            one = self._reading.setdefault(key, threading.Lock())
        with one:
            with self._lock:
                hit = self._held.get(key)
            if hit is not None:
                return hit
            with self._lock:
                known = self._known.pop(key, None)
            layout = _kept_layout(known) if known is not None else None
            if layout is None:
                layout = _read_layout(path, options, size)
            check(layout.schema)
            with self._lock:
                self._held[key] = layout
            return layout


def _object_footer(url: str, options: StorageOptions | None, known: int | None) -> tuple[pq.FileMetaData, int]:
    """An object's footer and size: one range GET given its indexed size `known`, else (or if that fails) HEAD + GET.

    A read at the indexed size of an object rewritten since (another size) ends short or past the footer's
    magic and fails; it is then HEADed and read at its real size, and the loader's shard check reports the change.
    """
    if known:
        try:
            with RangeFile(url, known, options) as f:
                return pq.read_metadata(f), known
        except (OSError, ValueError, pa.ArrowException, SourceDataError):
            pass
    size = identity(url, options).size
    with RangeFile(url, size, options) as f:
        return pq.read_metadata(f), size


def _read_layout(path: Location, options: StorageOptions | None, known: int | None = None) -> _Layout:
    """Read and parse one file's footer (SourceDataError naming the file if it is not Parquet)."""
    try:
        size: int | None = None
        if is_url(path):
            md, size = _object_footer(str(path), options, known)
        else:
            md = pq.read_metadata(str(path))
        schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise SourceDataError(str(path), f"not a readable Parquet file ({e})") from None
    sink = pa.BufferOutputStream()
    md.write_metadata_file(sink)
    return _layout_of(md, schema, size, sink.getvalue().to_pybytes())


def _kept_layout(known: tuple[int, bytes]) -> _Layout | None:
    """An object's layout from the footer the index kept (`layouts.parquet`) at its indexed size; no request.

    None: the bytes do not parse (the footer is then read from the object). The object may have changed since
    indexing: the shard check, which every read waits for before it uses a byte, refuses it then.
    """
    size, footer = known
    try:
        md = pq.read_metadata(pa.BufferReader(footer))
        schema = md.schema.to_arrow_schema()
    except (OSError, pa.ArrowException):
        return None
    return _layout_of(md, schema, int(size), footer)


def _layout_of(md: pq.FileMetaData, schema: pa.Schema, size: int | None, footer: bytes) -> _Layout:
    """A `_Layout` of a parsed footer `md` (`footer`: it serialized as a Parquet metadata file)."""
    sizes = np.array([md.row_group(i).num_rows for i in range(md.num_row_groups)], dtype=np.int64)
    nbytes = np.array([md.row_group(i).total_byte_size for i in range(md.num_row_groups)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    leaves, chunks = _chunk_spans(md)
    return _Layout(footer, schema, size, starts, nbytes, leaves, chunks)


def _chunk_spans(md: pq.FileMetaData) -> tuple[tuple[str, ...], np.ndarray]:
    """Each leaf column's top-level name, and each column chunk's byte range (dictionary page first, if any)."""
    n_col = md.num_columns
    leaves = tuple(md.schema.column(i).path.split(".")[0] for i in range(n_col))
    chunks = np.zeros((md.num_row_groups, n_col, 2), dtype=np.int64)
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for i in range(n_col):
            cc = rg.column(i)
            dict_at = cc.dictionary_page_offset if cc.has_dictionary_page else None
            start = int(dict_at) if dict_at else int(cc.data_page_offset)
            chunks[g, i] = (start, start + int(cc.total_compressed_size))
    return leaves, chunks


_OPEN: OpenFiles[_FileInfo] = OpenFiles()
"""The Parquet files open in this process (every reader's), least recently used let go past `OPEN_FILES`."""


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


class ParquetReader(FormatReader):
    """Scans and reads Parquet shards of one source."""

    def __init__(self, source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> None:
        super().__init__(source, tokenizer, images)  # checks that exactly one of the two fields is set
        self._field: str = source.tokens_field or source.text_field or ""
        self._pretokenized = source.tokens_field is not None
        self._owner = new_owner()  # this reader's key in the process's open files (`_OPEN`)
        self._layouts = FileLayouts()  # shared with this reader's siblings
        self.decoded = DecodeCounts()  # row groups decoded, shared with this reader's siblings

    # ---- file state -------------------------------------------------------------------------

    def _layout(self, path: Location, size: int | None = None) -> _Layout:
        """The file's layout from the shared store (read once, schema checked then; `size`: as indexed)."""

        def check(schema: pa.Schema) -> None:
            self._check_schema(path, schema)

        return self._layouts.get(path, self.source.storage_options, check, size)

    def _open(self, path: Location) -> _FileInfo:
        """This reader's open file `path` (opened again from its held footer if the process let it go)."""
        info = _OPEN.get(self._owner, str(path))
        if info is not None:
            return info
        layout = self._layout(path)
        handle: BinaryIO | None = None
        try:
            # A URL: pyarrow reads each row group's column chunks by range requests (the footer is held).
            if is_url(path):
                handle = RangeFile(str(path), int(layout.size or 0), self.source.storage_options)  # type: ignore[assignment]
                pf = pq.ParquetFile(handle, metadata=layout.metadata(), pre_buffer=False)
            else:
                pf = pq.ParquetFile(str(path), metadata=layout.metadata(), pre_buffer=False)
        except (OSError, pa.ArrowException) as e:
            if handle is not None:
                handle.close()
            raise SourceDataError(str(path), f"not a readable Parquet file ({e})") from None
        return _OPEN.put(self._owner, str(path), _FileInfo(pf, layout, handle))

    def open_files(self) -> int:
        """How many files this reader holds open now (at most `OPEN_FILES` per process for all readers)."""
        return _OPEN.count(self._owner)

    def _check_schema(self, path: Location, schema: pa.Schema) -> None:
        """Whole-file problems: a missing column or a content column of the wrong type."""
        names = set(schema.names)
        for col in [self._field, *self.source.metadata]:
            if col not in names:
                raise SourceDataError(
                    str(path),
                    f"no column {col!r} (columns: {', '.join(schema.names)})",
                    hint="fix the field names in the spec or the file",
                )
        t = schema.field(self._field).type
        if self._pretokenized:
            ok = _is_list(t) and pa.types.is_integer(t.value_type)
            want = "a list of integers (list<int32>, list<int64>, large_list)"
        else:
            ok = pa.types.is_string(t) or pa.types.is_large_string(t)
            want = "a string column"
        if not ok:
            which = "tokens_field" if self._pretokenized else "text_field"
            raise SourceDataError(
                str(path),
                f"column {self._field!r} ({which}) is {t}, expected {want}",
                hint="point the spec's field at the right column or use the other field kind",
            )

    def prepare(self, path: Location, size: int | None = None) -> None:
        """Read a file's (an object's: size and) footer into the store this reader shares (thread-safe).

        `size`: the object's size as the index recorded it; then its footer is one range GET, no HEAD.
        """
        self._layout(path, size)

    def layout_of(self, path: Location) -> bytes | None:
        """An object's footer, serialized (read once with the file; for the index's `layouts.parquet`); None locally."""
        return self._layout(path).footer if is_url(path) else None

    def hold_layouts(self, layouts: Mapping[str, tuple[int, bytes]]) -> None:
        """Objects' footers as the index kept them: `prepare` and every open of them then read no footer."""
        self._layouts.hold(layouts)

    def sibling(self) -> ParquetReader:
        """A reader of the same source sharing this one's layouts (its own files and handles)."""
        other = ParquetReader(self.source, self.tokenizer_spec, self.images)
        other._layouts = self._layouts
        other.decoded = self.decoded
        return other

    # ---- protocol -----------------------------------------------------------------------------

    def num_parts(self, path: Location, target_bytes: int) -> int:
        info = self._open(path)
        n_rg = len(info.rg_bytes)
        if n_rg == 0:
            return 1
        want = -(-int(info.rg_bytes.sum()) // max(int(target_bytes), 1))
        return int(min(max(want, 1), n_rg))

    def _part_row_groups(self, info: _FileInfo, part: int, num_parts: int) -> np.ndarray:
        """Row groups of `part`: contiguous, balanced by uncompressed bytes."""
        n_rg = len(info.rg_bytes)
        if not 0 <= part < num_parts:
            raise ValueError(f"part {part} out of range for {num_parts} parts")
        if n_rg == 0:
            return np.zeros(0, dtype=np.int64)
        weight = np.maximum(info.rg_bytes, 1).astype(np.float64)
        mid = np.cumsum(weight) - weight / 2
        owner = np.minimum((mid / weight.sum() * num_parts).astype(np.int64), num_parts - 1)
        return np.flatnonzero(owner == part)

    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        info = self._open(path)
        rgs = self._part_row_groups(info, part, num_parts)
        columns = [self._field, *[m for m in self.source.metadata if m != self._field]]
        if len(rgs) == 0:
            table = info.file.schema_arrow.empty_table().select(columns)
            first_rows = np.zeros(0, dtype=np.uint64)
        else:
            table = self._read_row_groups(path, info, rgs, columns)
            first_rows = np.concatenate(
                [np.arange(info.rg_starts[g], info.rg_starts[g + 1], dtype=np.uint64) for g in rgs]
            )
        col = table.column(self._field).combine_chunks()
        counts, checks, bad, reasons = self._count(col)
        errors: list[tuple[int | None, str]] = []
        if bad.any():
            bad_idx = np.flatnonzero(bad)
            if self.source.on_error is OnError.ERROR:
                i = int(bad_idx[0])
                why = f"column {self._field!r}: {reasons[i]}"
                raise SourceDataError(str(path), why, row=int(first_rows[i]))
            errors = [(int(first_rows[i]), f"column {self._field!r}: {reasons[int(i)]}") for i in bad_idx]
        keep = ~bad
        n_keep = int(keep.sum())
        out = pa.table(
            {
                "row": pa.array(first_rows[keep], type=pa.uint64()),
                "num_tokens": pa.array(counts[keep], type=pa.uint32()),
                "num_image_tokens": pa.array(np.zeros(n_keep, dtype=np.uint32), type=pa.uint32()),
                "checksum": pa.array(checks[keep], type=pa.uint32()),
            }
        )
        keep_arr = pa.array(keep)
        for m in self.source.metadata:
            out = out.append_column(m, table.column(m).filter(keep_arr))
        return ScanResult(rows=out, errors=errors)

    def _count(self, col: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """Token counts and checksums per row, a mask of bad rows, and the reason for each bad row.

        Pre-tokenized rows are hashed from the token column's values buffer as read (one pass, no copy
        per row); the checksums of bad rows are meaningless and dropped with them.
        """
        n = len(col)
        reasons: dict[int, str] = {}
        bad = np.zeros(n, dtype=bool)
        if col.null_count:
            nulls = col.is_null().to_numpy(zero_copy_only=False)
            bad |= nulls
            reasons.update({int(i): "null value" for i in np.flatnonzero(nulls)})
        if self._pretokenized:
            counts = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint32)
            flat_bad = self._bad_token_rows(col)
            for i, why in flat_bad.items():
                if not bad[i]:
                    bad[i] = True
                    reasons[i] = why
            checks = self._checksums(col)
        else:
            safe = col.fill_null("") if col.null_count else col
            counts, checks = self._tokenizer().count_and_check(safe)
        return counts, checks, bad, reasons

    @staticmethod
    def _checksums(col: pa.Array) -> np.ndarray:
        """Checksums of a list column's rows: the token ids in the column's own value type (`checksum_dtype`)."""
        if pa.types.is_fixed_size_list(col.type):
            col = col.cast(pa.list_(col.type.value_type))
        offsets = col.offsets.to_numpy().astype(np.int64)
        values = col.values
        if values.null_count:
            values = values.fill_null(0)
        flat = values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]  # the stored ids: hashed in place
        return checksums_flat(flat, offsets - offsets[0])

    def _bad_token_rows(self, col: pa.Array) -> dict[int, str]:
        """Rows whose token lists hold nulls or ids outside [0, int32 max]."""
        values = col.flatten()  # skips null lists and honours slicing
        if len(values) == 0:
            return {}
        mm = pc.min_max(values)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        in_range = (lo is None or lo >= 0) and (hi is None or hi <= _INT32_MAX)
        if values.null_count == 0 and in_range:
            return {}
        # Rare path: locate the offending rows.
        out: dict[int, str] = {}
        lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
        row_of_value = np.repeat(np.arange(len(col)), lengths)
        vals = values.to_numpy(zero_copy_only=False)
        null_mask = values.is_null().to_numpy(zero_copy_only=False)
        for i in np.unique(row_of_value[null_mask]):
            out[int(i)] = "null token id inside the list"
        valid = ~null_mask
        out_of_range = np.zeros(len(vals), dtype=bool)
        out_of_range[valid] = (vals[valid] < 0) | (vals[valid] > _INT32_MAX)
        for i in np.unique(row_of_value[out_of_range]):
            out.setdefault(int(i), f"token id outside [0, {_INT32_MAX}]")
        return out

    def _tokenizer(self) -> Tokenizer:
        return make_tokenizer(self.tokenizer_spec)

    def _read_row_groups(self, path: Location, info: _FileInfo, rgs: np.ndarray, columns: list[str]) -> pa.Table:
        """Row groups `rgs`' `columns`, decoded on Arrow's pool only where there are several columns: the pool
        decodes a column each, so one column gains nothing from it and pays the hand-offs (a loader's read of one
        row group's tokens, 1.2 vs 1.6 ms CPU here)."""
        try:
            return info.file.read_row_groups([int(g) for g in rgs], columns=columns, use_threads=len(columns) > 1)
        except (OSError, pa.ArrowException) as e:
            raise SourceDataError(
                str(path), f"cannot read row groups {int(rgs[0])}..{int(rgs[-1])} (corrupt or truncated: {e})"
            ) from None

    def _rows_of_group(self, path: Location, info: _FileInfo, g: int, rows: np.ndarray) -> tuple[pa.Array, np.ndarray]:
        """File rows `rows` (all in row group `g`) of the content column: an array that holds them (a kept unit
        or the freshly decoded group) and their positions in it; from the unit cache when it holds them."""
        key = (str(path), g)
        local = rows - info.rg_starts[g]
        hit = self.unit_cache.get(key)
        if hit is not None:
            got = _kept_at(hit, rows, local)
            if got is not None:
                return got
        arr = self._decode_row_group(path, info, g)
        kept = self._keep(key, info, g, arr, self.unit_cache.wanted(key))
        if kept is not None:
            self.unit_cache.put(key, kept[0], kept[1])
        return arr, local

    def _keep(
        self, key: UnitKey, info: _FileInfo, g: int, arr: pa.Array, rows: np.ndarray | None
    ) -> tuple[pa.Array | KeptRows, int] | None:
        """What to keep of decoded row group `g`: all of it (`rows` None, or most of it wanted), its `rows`, or nothing.

        Kept whole from `_WHOLE_SHARE` of its rows on: a take would save little, and a group many of whose rows
        are wanted (a plan over few sources) gains more rows with every chunk planned (each would drop it).
        What is kept is `_narrowed` (uint16 ids where they all fit) where under `_NARROW_SHARE` of its rows are wanted;
        a group most of whose rows are read (or kept with no rows named) stays as decoded: see the module docstring.
        `nbytes` counts what is kept.
        """
        if rows is None:
            return arr, arr.nbytes
        lo, hi = int(info.rg_starts[g]), int(info.rg_starts[g + 1])
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        rows = rows[(rows >= lo) & (rows < hi)]
        if len(rows) == 0:
            return None
        if len(rows) >= _WHOLE_SHARE * (hi - lo):
            whole = _narrowed(arr) if len(rows) < _NARROW_SHARE * (hi - lo) else arr
            return whole, whole.nbytes
        values = _narrowed(arr.take(pa.array(rows - lo)))
        return KeptRows(rows, values), values.nbytes + rows.nbytes

    def _decode_row_group(self, path: Location, info: _FileInfo, g: int) -> pa.Array:
        """Row group `g`'s content column as one array: the decoded chunk itself where there is one and it has no nulls
        (`_unmasked`, the token columns serving reads), else joined by `combine_chunks`, which copies even a single
        chunk: ~0.65 ms of a row group's ~2.7 ms of decoding on the delivery benchmark's 1.9 MB groups (session 29)."""
        column = self._read_row_groups(path, info, np.array([g]), [self._field]).column(0)
        whole = _unmasked(column.chunk(0)) if column.num_chunks == 1 else None
        arr = whole if whole is not None else column.combine_chunks()
        if self.decoded is not None:  # counted per group: its rows and (a token column) its ids
            self.decoded.add(len(arr), _ids_in(arr) if self._pretokenized else None)
        return arr

    def load_unit(
        self, path: Location, unit: int, rows: np.ndarray | None = None
    ) -> tuple[pa.Array | KeptRows, int] | None:
        """Row group `unit`'s content column (or its `rows`), decoded exactly as `read` keeps it (for a read ahead).

        None: none of `rows` is in that row group (nothing to keep).
        """
        info = self._open(path)
        if not 0 <= unit < len(info.rg_bytes):
            raise SourceDataError(str(path), f"no row group {unit} (file has {len(info.rg_bytes)})")
        arr = self._decode_row_group(path, info, int(unit))
        return self._keep((str(path), unit), info, int(unit), arr, rows)

    def unit_span(self, path: Location, unit: int) -> tuple[int, int] | None:
        """Row group `unit`'s content-column bytes in object `path` (None: a local file, its footer not held yet,
        or no such group). Makes no request: a read ahead plans its GETs from the footers held."""
        layout = self._layouts.peek(path) if is_url(path) else None
        if layout is None or not 0 <= unit < len(layout.rg_bytes):
            return None
        return layout.span(self._field, int(unit))

    def load_units(
        self, path: Location, units: Sequence[int], rows: Sequence[np.ndarray | None]
    ) -> list[tuple[pa.Array | KeptRows, int] | None]:
        """Row groups `units` of object `path` (neighbours, for a read ahead) from one range GET spanning their chunks.

        The span is fetched into the file's range buffer, then each group decodes from it as `load_unit` would.
        """
        info = self._open(path)
        if len(units) < 2 or not isinstance(info.handle, RangeFile):
            return super().load_units(path, units, rows)
        for u in units:
            if not 0 <= u < len(info.rg_bytes):
                raise SourceDataError(str(path), f"no row group {u} (file has {len(info.rg_bytes)})")
        spans = np.array([info.layout.span(self._field, int(u)) for u in units], dtype=np.int64)
        info.handle.preload(int(spans[:, 0].min()), int(spans[:, 1].max()))
        try:
            out: list[tuple[pa.Array | KeptRows, int] | None] = []
            for u, r in zip(units, rows, strict=True):
                arr = self._decode_row_group(path, info, int(u))
                out.append(self._keep((str(path), int(u)), info, int(u), arr, r))
            return out
        finally:
            info.handle.release()

    def unit_starts(self, path: Location) -> np.ndarray:
        """The first row of each row group and the file's row count at the end (a read unit is a row group); opens no
        file."""
        return self._layout(path).rg_starts

    @staticmethod
    def _check_rows(path: Location, info: _FileInfo, rows: np.ndarray, lo: int, hi: int) -> None:
        """SourceDataError naming the first of `rows` (smallest `lo`, largest `hi`) past the file's rows."""
        if lo < 0 or hi >= info.num_rows:
            badrow = int(rows[(rows < 0) | (rows >= info.num_rows)][0])
            raise SourceDataError(
                str(path),
                f"row out of range (file has {info.num_rows} rows)",
                row=badrow,
                hint="the index is stale for this file; re-run `loom index`",
            )

    def token_spans(self, path: Location, rows: np.ndarray) -> TokenSpans | None:
        """Rows (ascending, distinct) of a `list<int32>` token column without nulls, as views into their row groups.

        One binary search cuts the sorted rows into their row groups; each group comes from the unit cache (or
        is decoded and offered to it) as `read` does. None for text, other value types or nulls (`read` checks
        and converts those). A narrowed unit's buffer is uint16 (the ids of an int32 column: only a column
        stored as int32 gets here, so the caller hashes every span as int32).
        """
        if not self._pretokenized or not _int32_column(self._layout(path).schema.field(self._field).type):
            return None
        info = self._open(path)
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        empty = np.zeros(0, dtype=np.int64)
        if n == 0:
            return TokenSpans([], empty, empty, empty, empty)
        self._check_rows(path, info, rows, int(rows[0]), int(rows[-1]))
        cuts = np.searchsorted(rows, info.rg_starts).tolist()  # rows of group g: [cuts[g], cuts[g + 1])
        buffers: list[np.ndarray] = []
        buffer, unit = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        start, stop = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        for g, (a, b) in enumerate(itertools.pairwise(cuts)):
            if a == b:
                continue
            arr, at = self._rows_of_group(path, info, g, rows[a:b])
            if not _plain_tokens(arr):
                return None
            offsets = arr.offsets.to_numpy()
            start[a:b] = offsets[at]
            stop[a:b] = offsets[np.asarray(at) + 1]
            buffer[a:b] = len(buffers)
            unit[a:b] = g
            buffers.append(arr.values.to_numpy())
        return TokenSpans(buffers, buffer, start, stop, unit)

    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        info = self._open(path)
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return []
        self._check_rows(path, info, rows, int(rows.min()), int(rows.max()))
        rg_of = np.searchsorted(info.rg_starts, rows, side="right") - 1
        groups = np.unique(rg_of)
        order = np.argsort(rg_of, kind="stable")
        cuts = np.searchsorted(rg_of[order], groups, side="right")[:-1]
        held = [
            self._rows_of_group(path, info, int(g), rows[sel])
            for g, sel in zip(groups.tolist(), np.split(order, cuts), strict=True)
        ]
        if self._pretokenized:
            views = _token_views(held, order, len(rows))
            if views is not None:
                return [Sample(tokens=t) for t in views]
        # Take from each row group, then join the (small) takes: never concatenate whole row groups. A narrowed
        # kept unit's take is cast back to the file's column type, so it joins a fresh decode's (a group with a null).
        column = self._layout(path).schema.field(self._field).type
        takes = [_as_type(arr.take(pa.array(at)), column) for arr, at in held]
        taken = pa.concat_arrays(takes) if len(takes) > 1 else takes[0]
        if len(takes) > 1 and (np.diff(order) < 0).any():  # back to the order of `rows`
            taken = taken.take(pa.array(np.argsort(order)))
        if taken.null_count:
            i = int(np.flatnonzero(taken.is_null().to_numpy(zero_copy_only=False))[0])
            raise SourceDataError(str(path), f"column {self._field!r}: null value", row=int(rows[i]))
        tokens = self._tokens_of(path, taken)
        return [Sample(tokens=t) for t in tokens]

    def checksum_dtype(self, path: Location) -> np.dtype:
        """A token column's value type as this file stores it; for text, the tokenizer's (uint8: the bytes)."""
        if not self._pretokenized:
            return self._tokenizer().checksum_dtype
        return np.dtype(self._layout(path).schema.field(self._field).type.value_type.to_pandas_dtype())

    def _tokens_of(self, path: Location, taken: pa.Array) -> list[np.ndarray]:
        if not self._pretokenized:
            return self._tokenizer().encode_batch(taken)
        if pa.types.is_fixed_size_list(taken.type):
            taken = taken.cast(pa.list_(taken.type.value_type))
        offsets = taken.offsets.to_numpy()
        values = taken.values.to_numpy(zero_copy_only=False)
        flat = values[offsets[0] : offsets[-1]]
        if flat.dtype != np.int32 and len(flat) and (flat.min() < 0 or flat.max() > _INT32_MAX):
            raise SourceDataError(str(path), f"column {self._field!r}: token id outside [0, {_INT32_MAX}]")
        flat = flat.astype(np.int32)
        return np.split(flat, (offsets[1:-1] - offsets[0]).astype(np.intp))

    def close(self) -> None:
        for info in _OPEN.drop(self._owner):
            info.close()
        if isinstance(self.unit_cache, LruUnitCache):  # the default cache is the reader's own; a set one its owner's
            self.unit_cache.clear()


def _kept_at(value: pa.Array | KeptRows, rows: np.ndarray, local: np.ndarray) -> tuple[pa.Array, np.ndarray] | None:
    """File rows `rows` (`local` inside their row group) of a kept unit (whole or `KeptRows`): the array that holds
    them and their positions in it; None: not all kept."""
    if not isinstance(value, KeptRows):
        return value, local
    pos = np.searchsorted(value.rows, rows)
    ok = pos < len(value.rows)
    ok[ok] = value.rows[pos[ok]] == rows[ok]
    if not ok.all():
        return None
    return value.values, pos


def _ids_in(arr: pa.Array) -> int | None:
    """The token ids a decoded (large, fixed-size) list column holds, from its offsets (no pass over them)."""
    t = arr.type
    if pa.types.is_fixed_size_list(t):
        return len(arr) * t.list_size
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or len(arr) == 0:
        return 0 if len(arr) == 0 else None
    offsets = arr.offsets
    return int(offsets[len(arr)].as_py()) - int(offsets[0].as_py())


def _unmasked(arr: pa.Array) -> pa.Array | None:
    """A decoded (large) list of fixed-width ids without nulls, on its own buffers minus the validity bitmaps Parquet's
    reader allocates even where nothing is null (what `combine_chunks` would drop while copying): the same array and
    `nbytes` as the copy, with no copy. None for anything else (nulls, other types: those are combined as before)."""
    t = arr.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or arr.null_count or arr.offset:
        return None
    values = arr.values
    if values.null_count or not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        return None
    own = arr.buffers()  # validity, offsets, then the values' validity and data
    if own[0] is None and own[2] is None:
        return arr
    ids = pa.Array.from_buffers(values.type, len(values), [None, own[3]], null_count=0, offset=values.offset)
    return pa.Array.from_buffers(t, len(arr), [None, own[1]], null_count=0, children=[ids])


def _as_type(arr: pa.Array, column: pa.DataType) -> pa.Array:
    """`arr` in the column's stored type: a `_narrowed` unit's uint16 values widened back (a safe cast)."""
    return arr if arr.type == column else arr.cast(column)


def _int32_column(t: pa.DataType) -> bool:
    """Whether `t` is a (large) list of int32: the token column type whose units are read as views (and narrowed)."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type == pa.int32()


def _plain_tokens(arr: pa.Array) -> bool:
    """Whether `arr` is a (large) list of int32, or of uint16 (a `_narrowed` unit), with no null list or id: its
    values buffer holds every row's tokens."""
    t = arr.type
    ok = (pa.types.is_list(t) or pa.types.is_large_list(t)) and t.value_type in (pa.int32(), pa.uint16())
    return bool(ok and not arr.null_count and not arr.values.null_count)


def _narrowed(arr: pa.Array) -> pa.Array:
    """`arr` (a unit to keep) with uint16 values on the same offsets where it is a (large) list of int32 without
    nulls whose every id is in [0, 65535]; else `arr` itself. Half the bytes for vocabularies under 65,536.

    One pass checks the range (an OR of the values has no bit above the 16th: no id over 65535, none negative), one
    Arrow cast makes the uint16 values (in Arrow's memory pool, as the unit was).
    """
    if not _int32_column(arr.type) or arr.null_count or arr.values.null_count or len(arr) == 0:
        return arr
    offsets = arr.offsets
    bounds = offsets.to_numpy()
    first, last = int(bounds[0]), int(bounds[-1])
    if last == first:
        return arr
    values = arr.values
    if first != 0 or last != len(values):  # a slice: keep only the values it covers
        values = values.slice(first, last - first)
        offsets = pa.array(bounds - bounds.dtype.type(first))
    if int(np.bitwise_or.reduce(values.to_numpy())) & ~_NARROW_MAX:
        return arr
    narrow = values.cast(pa.uint16(), safe=False)
    make = pa.LargeListArray if pa.types.is_large_list(arr.type) else pa.ListArray
    return make.from_arrays(offsets, narrow)


def _token_views(held: list[tuple[pa.Array, np.ndarray]], order: np.ndarray, n: int) -> list[np.ndarray] | None:
    """Each row's tokens as a read-only view into the Arrow array that holds it (no take, no copy), in the order of
    the rows asked for (`order`: row index by group, as `held`); None when a group's column is not a list of int32
    (or a `_narrowed` unit's uint16) without nulls (those rows go through a take and `_tokens_of`, which check and
    convert). A narrowed unit's rows are widened to int32 copies (`Sample.tokens` is int32).

    A take of a list column copies every selected token and costs tens of microseconds per row group; the loader
    copies the segments it serves out of these views once.
    """
    out: list[np.ndarray] = [_EMPTY] * n
    k = 0
    for arr, at in held:
        if not _plain_tokens(arr):
            return None
        offsets = arr.offsets.to_numpy()
        flat = arr.values.to_numpy()
        at = np.asarray(at, dtype=np.int64)
        for j, a, b in zip(
            order[k : k + len(at)].tolist(), offsets[at].tolist(), offsets[at + 1].tolist(), strict=True
        ):
            out[j] = flat[a:b]
        if flat.dtype != np.int32:
            for j in order[k : k + len(at)].tolist():
                out[j] = out[j].astype(np.int32)
        k += len(at)
    return out


_EMPTY = np.zeros(0, dtype=np.int32)

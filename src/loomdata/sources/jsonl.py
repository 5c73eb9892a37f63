"""JSON Lines sources (plain, `.gz`, `.zst`): one JSON object per line with a raw text field.

Plain files split into byte ranges; a part owns the lines that start inside its range, and `row` is
the byte offset of the line, so `read` seeks straight to it (memory-mapped). Compressed files cannot
be entered in the middle: they are one part, `row` is the 0-based line number, and `read` has to
decompress from the start. A reader keeps the decompressed bytes and line offsets of recently read
compressed files (up to 256 MiB in all), so only the first read of such a file pays a full
decompression; files larger than that budget are decompressed again, up to the last requested
line, on every `read` call. Keep large corpora in plain JSONL (or Parquet) for random access.

Scanning parses blocks of lines with Arrow's JSON reader (columnar, only the text and metadata
fields) and falls back to `json.loads` line by line when a block holds a bad line, to name that line,
or a value the columnar path cannot carry. Blank lines are skipped and are not errors.

Metadata fields (`metadata: [url, lang, ...]`) become index columns whose Arrow type follows from the
JSON kind of their values alone, so every part, block and shard of a source agrees:

- numbers (integers included) -> float64 (integers beyond 2**53 lose precision),
- true/false -> bool,
- strings -> string, and objects or arrays -> string holding their compact JSON text
  (`json.dumps(v, ensure_ascii=False, separators=(",", ":"))`; these lines take the per-line path),
- a missing field or null -> null; a column with no value at all in a part has type null (the index
  job's permissive concatenation turns it into the type of the other parts).

A field holding numbers on one line and text (or booleans) on another has no single type: the scan
fails with a SourceDataError naming the file and line, whatever `on_error` says (with `skip` the job
skips the whole shard), and parts of one source that disagree fail the index job. Make the field's
kind the same everywhere or drop it from `metadata`.
"""

from __future__ import annotations

import collections
import enum
import gzip
import json
import mmap
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import zstandard

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.records import OnError
from loomdata.sources._base import FormatReader, Sample, ScanResult
from loomdata.sources.tokenizer import make_tokenizer
from loomdata.storage import Location, ObjectView, StorageOptions, identity, is_url, open_input, suffix_of

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = ["Compression", "JsonlReader", "compression_of"]

_BLOCK = 16 * 1024 * 1024  # bytes of (decompressed) input parsed at once
_CACHE_BYTES = 256 * 1024 * 1024  # decompressed compressed-file contents kept by one reader
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True
_PROBE_LINES = 32  # lines of a block parsed in Python to guess the kinds of not-yet-seen metadata fields
_KIND_NAMES = {pa.float64(): "numbers", pa.bool_(): "booleans", pa.string(): "text (strings, objects or arrays)"}
_Errors = list[tuple[int | None, str]]


def _kind_of(value: object) -> pa.DataType | None:
    """The Arrow type a JSON value is carried as (None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int | float):
        return pa.float64()
    return pa.string()


def _carried(value: object) -> object:
    """A JSON value as it is carried in its column: floats, bools, strings, or compact JSON text."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _first_valid(col: pa.Array) -> int:
    """Position of the first non-null value of a column that has one."""
    return int(np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False))[0])


class Compression(enum.Enum):
    """How a JSONL file is compressed, from its name."""

    NONE = "none"
    GZIP = "gzip"
    ZSTD = "zstd"


def compression_of(path: Location) -> Compression:
    """`.gz` is gzip, `.zst`/`.zstd` is Zstandard, anything else is plain text."""
    suffix = suffix_of(path).lower()
    if suffix == ".gz":
        return Compression.GZIP
    if suffix in (".zst", ".zstd"):
        return Compression.ZSTD
    return Compression.NONE


@dataclass(frozen=True, slots=True)
class _Lines:
    """Complete lines of one block: the block, line starts/ends in it, and their `row` values."""

    offset: int  # of the block in the (decompressed) file
    data: bytes
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64, exclusive, without the newline
    rows: np.ndarray  # uint64: byte offsets in the file (plain) or line numbers (compressed)


def _split_lines(offset: int, data: bytes, first_line: int | None) -> _Lines:
    """Split a block of complete lines; rows are byte offsets, or line numbers from `first_line`."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [len(buf)]]).astype(np.int64)
    if len(starts) and starts[-1] == len(buf):  # nothing after the last newline
        starts, ends = starts[:-1], ends[:-1]
    rows = offset + starts if first_line is None else first_line + np.arange(len(starts), dtype=np.int64)
    return _Lines(offset, data, starts, ends, rows.astype(np.uint64))


def _nonblank(lines: _Lines) -> np.ndarray:
    """Which lines hold something besides whitespace (a line starting with non-space is never blank)."""
    out = lines.ends > lines.starts
    if out.any():
        first = np.frombuffer(lines.data, dtype=np.uint8)[lines.starts[out]]
        maybe = np.flatnonzero(out)[_WS[first]]  # rare: lines that start with whitespace
        for i in maybe.tolist():
            out[i] = bool(lines.data[lines.starts[i] : lines.ends[i]].strip())
    return out


def _gzip_chunks(path: Location, size: int, options: StorageOptions | None = None) -> Iterator[bytes]:
    with open_input(path, options) as raw, gzip.open(raw, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def _zstd_chunks(path: Location, size: int, options: StorageOptions | None = None) -> Iterator[bytes]:
    """Decompressed chunks of every frame; a frame cut short raises (zstandard's reader would not)."""
    dctx = zstandard.ZstdDecompressor()
    with open_input(path, options) as f:
        dobj = dctx.decompressobj()
        open_frame = False
        while data := f.read(size):
            while data:
                out = dobj.decompress(data)
                open_frame = True
                if out:
                    yield out
                if dobj.eof:
                    data = dobj.unused_data
                    dobj = dctx.decompressobj()
                    open_frame = False
                else:
                    data = b""
        if open_frame:
            raise EOFError("the Zstandard stream ends inside a frame")


def _stream(path: Location, comp: Compression, options: StorageOptions | None = None) -> Iterator[bytes]:
    """Decompressed chunks of a compressed file; decoder errors become SourceDataError naming it.

    A zero-byte file is not a valid gzip or Zstandard stream (the decoders yield nothing for it): it is a
    bad file, never silently an empty one.
    """
    try:
        empty = identity(path, options).size == 0
    except OSError as e:
        raise SourceDataError(str(path), f"cannot read file ({e.strerror})") from None
    if empty:
        raise SourceDataError(
            str(path), f"zero bytes: not a {comp.value} stream (an empty file compressed still has a header)"
        )
    gen = _gzip_chunks(path, _BLOCK, options) if comp is Compression.GZIP else _zstd_chunks(path, _BLOCK // 4, options)
    try:
        yield from gen
    except (EOFError, OSError, zlib.error, zstandard.ZstdError) as e:
        raise SourceDataError(
            str(path), f"truncated or corrupt {comp.value} stream ({e})", hint="re-create or remove the file"
        ) from None


def _line_blocks(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(offset, block) pairs of complete lines, regrouped from arbitrary chunks."""
    pending: list[bytes] = []
    offset = 0
    for chunk in chunks:
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            pending.append(chunk)  # a line longer than a chunk: gather without quadratic copies
            continue
        block = b"".join([*pending, chunk[:cut]]) if pending else chunk[:cut]
        yield offset, block
        offset += len(block)
        pending = [chunk[cut:]] if cut < len(chunk) else []
    if pending:
        yield offset, b"".join(pending)


def _read_range(f: BinaryIO, start: int, stop: int) -> Iterator[bytes]:
    """Chunks of bytes [start, stop) of an open file."""
    f.seek(start)
    pos = start
    while pos < stop:
        chunk = f.read(min(_BLOCK, stop - pos))
        if not chunk:
            return
        pos += len(chunk)
        yield chunk


class _Where:
    """`line N: ` prefixes for error messages; plain files count newlines forward, only when asked."""

    def __init__(self, path: Location, comp: Compression, options: StorageOptions | None = None) -> None:
        self._path = path
        self._comp = comp
        self._options = options
        self._pos = 0
        self._lines = 0

    def __call__(self, row: int) -> str:
        if self._comp is not Compression.NONE:
            return f"line {row + 1}: "
        if row < self._pos:
            self._pos, self._lines = 0, 0
        with open_input(self._path, self._options) as f:
            for chunk in _read_range(f, self._pos, row):
                self._lines += chunk.count(b"\n")
        self._pos = row
        return f"line {self._lines + 1} (byte {row}): "


class JsonlReader(FormatReader):
    """Scans and reads JSONL shards of one source (plain, gzip or Zstandard)."""

    def __init__(self, source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> None:
        super().__init__(source, tokenizer, images)  # checks that `text_field` is set
        self._field: str = source.text_field or ""
        self._meta: list[str] = list(dict.fromkeys(source.metadata))
        self._guess: dict[str, pa.DataType] = {}  # kinds seen so far: only speed depends on them
        self._maps: dict[Location, tuple[BinaryIO | None, mmap.mmap | ObjectView | None]] = {}
        self._decoded: collections.OrderedDict[Location, _Lines] = collections.OrderedDict()
        self._decoded_bytes = 0
        self._opts = source.storage_options

    # ---- protocol -----------------------------------------------------------------------------

    def num_parts(self, path: Location, target_bytes: int) -> int:
        size = self._size(path)
        if compression_of(path) is not Compression.NONE or size == 0:
            return 1
        return max(1, -(-size // max(int(target_bytes), 1)))

    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        if not 0 <= part < num_parts:
            raise ValueError(f"part {part} out of range for {num_parts} parts")
        comp = compression_of(path)
        rows: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        checks: list[np.ndarray] = []
        errors: _Errors = []
        meta: dict[str, list[pa.Array]] = {m: [] for m in self._meta}
        kinds: dict[str, pa.DataType] = {}  # the type of each metadata field in this part, once seen
        where = _Where(path, comp, self._opts)
        for lines in self._blocks_of_part(path, comp, part, num_parts):
            r, c, k, e, cols = self._scan_block(path, lines, where, kinds)
            self._settle_kinds(path, r, cols, kinds, where)
            rows.append(r)
            counts.append(c)
            checks.append(k)
            errors.extend(e)
            for m, col in cols.items():
                meta[m].append(col)
        row = np.concatenate(rows) if rows else np.zeros(0, dtype=np.uint64)
        cnt = np.concatenate(counts) if counts else np.zeros(0, dtype=np.uint32)
        chk = np.concatenate(checks) if checks else np.zeros(0, dtype=np.uint32)
        columns: dict[str, pa.Array | pa.ChunkedArray] = {
            "row": pa.array(row, type=pa.uint64()),
            "num_tokens": pa.array(cnt, type=pa.uint32()),
            "num_image_tokens": pa.array(np.zeros(len(row), dtype=np.uint32), type=pa.uint32()),
            "checksum": pa.array(chk, type=pa.uint32()),
        }
        for m in self._meta:
            kind = kinds.get(m, pa.null())
            columns[m] = pa.chunked_array([c.cast(kind) for c in meta[m]], type=kind)
        return ScanResult(rows=pa.table(columns), errors=errors)

    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return []
        comp = compression_of(path)
        raw = self._raw_plain(path, rows) if comp is Compression.NONE else self._raw_compressed(path, comp, rows)
        texts = [self._text_of_line(path, comp, int(r), line) for r, line in zip(rows, raw, strict=True)]
        return [Sample(tokens=t) for t in make_tokenizer(self.tokenizer_spec).encode_batch(texts)]

    def checksum_dtype(self, path: Location) -> np.dtype:
        """The tokenizer's (uint8 with the byte tokenizer: the raw UTF-8 text is hashed)."""
        return make_tokenizer(self.tokenizer_spec).checksum_dtype

    def close(self) -> None:
        for f, mm in self._maps.values():
            if isinstance(mm, mmap.mmap):
                mm.close()
            if f is not None:
                f.close()
        self._maps.clear()
        self._decoded.clear()
        self._decoded_bytes = 0

    # ---- scanning -----------------------------------------------------------------------------

    def _size(self, path: Location) -> int:
        try:
            return identity(path, self._opts).size
        except OSError as e:
            raise SourceDataError(str(path), f"cannot read file ({e.strerror})") from None

    def _blocks_of_part(self, path: Location, comp: Compression, part: int, num_parts: int) -> Iterator[_Lines]:
        if comp is not Compression.NONE:
            if part != 0:  # one part only; later parts are empty
                return
            line0 = 0
            for off, block in _line_blocks(_stream(path, comp, self._opts)):
                lines = _split_lines(off, block, line0)
                line0 += len(lines.starts)
                yield lines
            return
        size = self._size(path)
        lo, hi = part * size // num_parts, (part + 1) * size // num_parts
        try:
            with open_input(path, self._opts, size=size) as f:
                start = 0 if lo == 0 else self._next_line_start(f, lo - 1)
                if start >= hi:
                    return
                stop = self._next_line_start(f, hi - 1)
                for off, block in _line_blocks(_read_range(f, start, stop)):
                    yield _split_lines(start + off, block, None)
        except OSError as e:
            raise SourceDataError(str(path), f"cannot read file ({e})") from None

    @staticmethod
    def _next_line_start(f: BinaryIO, pos: int) -> int:
        """The first line start after the first newline at or after `pos` (or end of file)."""
        f.seek(pos)
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                return f.tell()
            i = chunk.find(b"\n")
            if i >= 0:
                return f.tell() - len(chunk) + i + 1

    def _settle_kinds(
        self, path: Location, rows: np.ndarray, cols: dict[str, pa.Array], kinds: dict[str, pa.DataType], where: _Where
    ) -> None:
        """Record each metadata column's type in this part; a block of another kind is an error."""
        for m, col in cols.items():
            if col.type == pa.null():
                continue
            seen = kinds.setdefault(m, col.type)
            self._guess[m] = col.type
            if seen != col.type:
                r = int(rows[_first_valid(col)])
                raise self._kind_error(path, where(r), r, m, col.type, seen)

    def _kind_error(
        self, path: Location, at: str, row: int, field: str, got: pa.DataType, seen: pa.DataType
    ) -> SourceDataError:
        """The error for a metadata field whose kind differs from that of earlier lines."""
        return SourceDataError(
            str(path),
            f"{at}metadata field {field!r} holds {_KIND_NAMES[got]}, but earlier lines hold {_KIND_NAMES[seen]}",
            row=row,
            hint=f"give {field!r} one kind of value (or null) on every line, or drop it from the source's `metadata`",
        )

    def _scan_block(
        self, path: Location, lines: _Lines, where: _Where, kinds: dict[str, pa.DataType]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Errors, dict[str, pa.Array]]:
        """Rows, token counts, checksums, skipped lines and metadata columns of one block."""
        keep = _nonblank(lines)
        rows = lines.rows[keep]
        fast = self._fast_block(lines, keep, kinds)
        if fast is not None:
            texts, cols = fast
            counts, checks = make_tokenizer(self.tokenizer_spec).count_and_check(texts)
            return rows, counts, checks, [], cols
        # Slow path: parse each line to find and name the bad ones.
        good_rows: list[int] = []
        good_texts: list[str] = []
        values: dict[str, list[object]] = {m: [] for m in self._meta}
        line_kinds = dict(kinds)
        errors: _Errors = []
        for s, e, r in zip(lines.starts[keep], lines.ends[keep], rows, strict=True):
            text, obj, why = self._parse(lines.data[s:e])
            if why is None:
                why = self._check_meta(path, where, int(r), obj, line_kinds)
            if why is None:
                good_rows.append(int(r))
                good_texts.append(text)
                for m in self._meta:
                    values[m].append(_carried(obj.get(m)))
            elif self.source.on_error is OnError.ERROR:
                raise SourceDataError(str(path), where(int(r)) + why, row=int(r))
            else:
                errors.append((int(r), where(int(r)) + why))
        counts, checks = make_tokenizer(self.tokenizer_spec).count_and_check(good_texts)
        cols = {m: pa.array(values[m], type=line_kinds.get(m, pa.null())) for m in self._meta}
        return np.array(good_rows, dtype=np.uint64), counts, checks, errors, cols

    def _check_meta(
        self, path: Location, where: _Where, row: int, obj: dict[str, object], kinds: dict[str, pa.DataType]
    ) -> str | None:
        """Why a parsed line's metadata cannot be carried (None if it can); raises on a kind clash."""
        found: dict[str, pa.DataType] = {}
        for m in self._meta:
            value = obj.get(m)
            kind = _kind_of(value)
            if kind is None:
                continue
            if kind == pa.string():
                try:
                    str(_carried(value)).encode("utf-8")
                except UnicodeEncodeError:
                    return f"metadata field {m!r} holds an unpaired surrogate (not valid Unicode)"
            found[m] = kind
        for m, kind in found.items():
            seen = kinds.setdefault(m, kind)
            if seen != kind:
                raise self._kind_error(path, where(row), row, m, kind, seen)
        return None

    def _guesses(self, lines: _Lines, keep: np.ndarray, kinds: dict[str, pa.DataType]) -> dict[str, pa.DataType]:
        """Types to try per metadata field: the part's kinds, else earlier or probed ones (speed only)."""
        guess = {**self._guess, **kinds}
        unknown = [m for m in self._meta if m not in guess and m != self._field]
        if unknown:  # a bounded look at the block's first lines, not a per-line loop
            for s, e in list(zip(lines.starts[keep], lines.ends[keep], strict=True))[:_PROBE_LINES]:
                try:
                    obj = json.loads(lines.data[s:e])
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    for m in unknown:
                        kind = _kind_of(obj.get(m))
                        if kind is not None:
                            guess.setdefault(m, kind)
        return guess

    def _read_block(self, lines: _Lines, fields: list[tuple[str, pa.DataType]]) -> pa.Table | None:
        """The block's `fields` via Arrow's JSON reader, or None if a line does not fit them."""
        try:
            return pajson.read_json(
                pa.BufferReader(lines.data),
                read_options=pajson.ReadOptions(use_threads=False, block_size=len(lines.data) + 1),
                parse_options=pajson.ParseOptions(
                    explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"
                ),
            )
        except (pa.ArrowException, UnicodeDecodeError, ValueError):
            return None

    def _fast_block(
        self, lines: _Lines, keep: np.ndarray, kinds: dict[str, pa.DataType]
    ) -> tuple[pa.Array, dict[str, pa.Array]] | None:
        """Texts and metadata columns via Arrow's JSON reader, or None if any line needs a closer look."""
        expected = int(keep.sum())
        if expected == 0:
            return pa.array([], type=pa.large_string()), {m: pa.nulls(0) for m in self._meta}
        guess = self._guesses(lines, keep, kinds)
        carried = [m for m in self._meta if m != self._field]
        text_field = (self._field, pa.large_string())
        table = self._read_block(lines, [text_field, *[(m, guess.get(m, pa.null())) for m in carried]])
        unknown = [m for m in carried if m not in guess]
        if table is None and unknown:
            # Fields not seen yet hold values: find each one's kind with single-field reads, then retry.
            for m in unknown:
                kind = next((t for t in _KIND_NAMES if self._read_block(lines, [(m, t)]) is not None), None)
                if kind is None:
                    return None  # mixed kinds, or objects/arrays: the per-line path decides
                guess[m] = kind
            table = self._read_block(lines, [text_field, *[(m, guess[m]) for m in carried]])
        if table is None or table.num_rows != expected:
            return None
        text = table.column(self._field).combine_chunks()
        if text.null_count:
            return None
        cols: dict[str, pa.Array] = {}
        for m in self._meta:
            col = text.cast(pa.string()) if m == self._field else table.column(m).combine_chunks()
            cols[m] = pa.nulls(len(col)) if col.null_count == len(col) else col
        try:  # Arrow passes invalid UTF-8 through; json.loads (and so `read`) rejects such a line
            for col in (text, *(c for m, c in cols.items() if m != self._field and c.type == pa.string())):
                col.validate(full=True)
        except pa.ArrowInvalid:
            return None
        return text, cols

    def _parse(self, line: bytes) -> tuple[str, dict[str, object], str | None]:
        """The text and object of one line, or an explanation of why it has no text."""
        try:
            obj = json.loads(line)
        except ValueError as e:  # includes UnicodeDecodeError
            return "", {}, f"not valid JSON ({e})"
        if not isinstance(obj, dict):
            return "", {}, f"expected a JSON object, got {type(obj).__name__}"
        if self._field not in obj:
            return "", obj, f"no field {self._field!r}"
        text = obj[self._field]
        if not isinstance(text, str):
            return "", obj, f"field {self._field!r} is {type(text).__name__}, expected a string"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "", obj, f"field {self._field!r} holds an unpaired surrogate (not valid Unicode)"
        return text, obj, None

    # ---- reading ------------------------------------------------------------------------------

    def _mmap(self, path: Location) -> mmap.mmap | ObjectView | None:
        """A memory map of a local file; a range-reading view of an object (read in 256 KiB pages)."""
        entry = self._maps.get(path)
        if entry is None and is_url(path):
            n = self._size(path)
            entry = (None, ObjectView(str(path), n, self._opts) if n else None)
            self._maps[path] = entry
        if entry is None:
            try:
                f = open(path, "rb")  # noqa: SIM115 (kept open with the map until close())
            except OSError as e:
                raise SourceDataError(str(path), f"cannot read file ({e.strerror})") from None
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            entry = (f, mm)
            self._maps[path] = entry
        return entry[1]

    def _raw_plain(self, path: Location, rows: np.ndarray) -> list[bytes]:
        mm = self._mmap(path)
        size = 0 if mm is None else len(mm)
        out = []
        for r in rows.tolist():
            if mm is None or not 0 <= r < size or (r > 0 and mm[r - 1] != 10):
                raise SourceDataError(
                    str(path),
                    f"byte offset {r} is not the start of a line (file has {size} bytes)",
                    row=r,
                    hint="the index is stale for this file; re-run `loom index`",
                )
            end = mm.find(b"\n", r)
            out.append(mm[r : end if end >= 0 else size])
        return out

    def _decode_all(self, path: Location, comp: Compression, upto: int) -> _Lines:
        """Decompressed lines up to line `upto` (all of them, cached, when the file fits the budget)."""
        cached = self._decoded.get(path)
        if cached is not None:
            self._decoded.move_to_end(path)
            return cached
        parts: list[bytes] = []
        total = 0
        n_lines = 0
        complete = True
        for _, block in _line_blocks(_stream(path, comp, self._opts)):
            parts.append(block)
            total += len(block)
            n_lines += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
            if total > _CACHE_BYTES and n_lines > upto:
                complete = False
                break
        lines = _split_lines(0, b"".join(parts), 0)
        if complete:
            self._decoded[path] = lines
            self._decoded_bytes += len(lines.data)
            while self._decoded_bytes > _CACHE_BYTES and len(self._decoded) > 1:
                _, old = self._decoded.popitem(last=False)
                self._decoded_bytes -= len(old.data)
        return lines

    def _raw_compressed(self, path: Location, comp: Compression, rows: np.ndarray) -> list[bytes]:
        lines = self._decode_all(path, comp, int(rows.max()))
        n = len(lines.starts)
        bad = (rows < 0) | (rows >= n)
        if bad.any():
            r = int(rows[bad][0])
            raise SourceDataError(
                str(path),
                f"line {r + 1} does not exist (the file has {n} lines)",
                row=r,
                hint="the index is stale for this file; re-run `loom index`",
            )
        return [lines.data[lines.starts[r] : lines.ends[r]] for r in rows.tolist()]

    def _text_of_line(self, path: Location, comp: Compression, row: int, line: bytes) -> str:
        text, _, why = self._parse(line)
        if why is not None:
            raise SourceDataError(str(path), _Where(path, comp, self._opts)(row) + why, row=row)
        return text

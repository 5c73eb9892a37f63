"""Megatron indexed datasets: `PREFIX.idx` + `PREFIX.bin` pairs (megatron-core `IndexedDatasetBuilder`).

One sample is one *sequence* of the dataset and `row` is its sequence index. Megatron also groups
sequences into *documents* (`document_indices`: sequence index where each document starts, plus
the total); `preprocess_data.py` without sentence splitting writes one sequence per document, with
it one sequence per sentence. Ask for the metadata column `document` to carry each sequence's
document number into the index.

The .idx layout (little-endian): magic `MMIDIDX\\x00\\x00`, version u64 (= 1), dtype code u8,
sequence count S u64, document count D u64 (entries of `document_indices`, one more than the number
of documents), then `lengths` int32[S], `pointers` int64[S] (byte offset of each sequence in the
.bin), `document_indices` int64[D], and for multimodal datasets `modes` int8[S]. The .bin holds the
tokens of all sequences back to back in that dtype.

Scanning reads the .idx (memory-mapped) and the .bin, whose tokens it checksums in the .bin's own dtype
(in place, `checksum_dtype`); `read` memory-maps the .bin once per file and slices the requested sequences.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.formats import DOCUMENT_COLUMN
from loomdata.sources._base import FormatReader, Sample, ScanResult
from loomdata.sources._integrity import checksums_flat
from loomdata.storage import Location, ObjectView, StorageOptions, fetch_to_cache, identity, is_url, suffix_of

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = ["DOCUMENT_COLUMN", "DTYPE_CODES", "IDX_HEADER", "IDX_MAGIC", "IDX_VERSION", "MegatronReader"]

# The .idx format, shared with the test writer (`loomdata.testing.write_megatron`).
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# megatron-core's DType codes (indexed_dataset.DType); float codes exist there but hold no tokens.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_FLOAT_CODES = {6: "float64", 7: "float32"}
_SAFE_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))  # every value is a valid int32 token id
_INT32_MAX = int(np.iinfo(np.int32).max)
_ROWS_PER_PART_MIN = 1 << 20  # never split an index into parts smaller than this many sequences
_STALE = "the index is stale for this dataset; re-run `loom index`"


@dataclass(frozen=True, slots=True)
class _Index:
    """A parsed, validated .idx: arrays are read-only views of one memory map."""

    idx_path: Location
    bin_path: Location
    dtype: np.dtype
    lengths: np.ndarray  # int32[S]
    pointers: np.ndarray  # int64[S], byte offsets into the .bin
    document_indices: np.ndarray  # int64[D]
    bin_size: int
    stamp: tuple[int, int, int, int]  # (idx size, idx mtime, bin size, bin mtime): detects rewrites

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)


def _paths(prefix: Location) -> tuple[Location, Location]:
    if is_url(prefix):
        return f"{prefix}.idx", f"{prefix}.bin"
    return Path(f"{prefix}.idx"), Path(f"{prefix}.bin")


def _stamp(idx_path: Location, bin_path: Location, options: StorageOptions | None = None) -> tuple[int, int, int, int]:
    """Sizes and mtimes (objects: a CRC of the ETag/version) of both files; a missing file is a SourceDataError."""
    out: list[int] = []
    for p in (idx_path, bin_path):
        try:
            ident = identity(p, options)
        except OSError as e:
            raise SourceDataError(
                str(p),
                f"missing or unreadable Megatron {suffix_of(p)} file ({e.strerror})",
                hint="a Megatron source needs both PREFIX.idx and PREFIX.bin; restore the file or fix `paths`",
            ) from None
        out += [ident.size, ident.mtime_ns or zlib.crc32(ident.version.encode())]
    return out[0], out[1], out[2], out[3]


class _RemoteTokens:
    """A .bin object as a sliceable token array: `tokens[a:b]` is one range read (256 KiB pages cached)."""

    def __init__(self, url: str, size: int, dtype: np.dtype, options: StorageOptions | None) -> None:
        self._view = ObjectView(url, size, options)
        self._dtype = dtype

    def __getitem__(self, key: slice) -> np.ndarray:
        isz = self._dtype.itemsize
        return np.frombuffer(self._view[key.start * isz : key.stop * isz], dtype=self._dtype)


def _parse_index(prefix: Location, options: StorageOptions | None = None) -> _Index:
    """Read and check the .idx header and arrays (never the .bin's content, only its size).

    An object's .idx is fetched once to the local cache (`loomdata.storage.cache_dir`) and memory-mapped
    from there; its .bin stays remote and is read by range.
    """
    idx_path, bin_path = _paths(prefix)
    stamp = _stamp(idx_path, bin_path, options)
    local_idx = fetch_to_cache(str(idx_path), options) if is_url(idx_path) else idx_path
    idx_size, bin_size = stamp[0], stamp[2]
    rebuild = "rebuild it with Megatron's preprocess_data.py (or IndexedDatasetBuilder)"
    if idx_size < IDX_HEADER.size:
        why = f"truncated .idx: {idx_size} bytes, shorter than the {IDX_HEADER.size}-byte header"
        raise SourceDataError(str(idx_path), why, hint=rebuild)
    with open(local_idx, "rb") as f:
        magic, version, code, n_seq, n_doc = IDX_HEADER.unpack(f.read(IDX_HEADER.size))
    if magic != IDX_MAGIC:
        raise SourceDataError(
            str(idx_path), f"not a Megatron .idx file (magic {magic!r}, expected {IDX_MAGIC!r})", hint=rebuild
        )
    if version != IDX_VERSION:
        raise SourceDataError(
            str(idx_path), f"unsupported .idx version {version} (loomdata reads version {IDX_VERSION})", hint=rebuild
        )
    if code in _FLOAT_CODES:
        raise SourceDataError(
            str(idx_path), f".bin dtype is {_FLOAT_CODES[code]}, not token ids", hint="use an integer token dtype"
        )
    if code not in DTYPE_CODES:
        raise SourceDataError(str(idx_path), f"unknown dtype code {code} in the .idx header", hint=rebuild)
    dtype = DTYPE_CODES[code]
    base = IDX_HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx_size not in (base, base + n_seq):  # + n_seq: the int8 modes of a multimodal dataset
        raise SourceDataError(
            str(idx_path),
            f"truncated or corrupt .idx: {idx_size} bytes, but the header's {n_seq} sequences and {n_doc} "
            f"document indices need {base} (or {base + n_seq} with modes)",
            hint=rebuild,
        )
    mm = np.memmap(local_idx, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=IDX_HEADER.size)
    pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=IDX_HEADER.size + 4 * n_seq)
    docs = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=IDX_HEADER.size + 12 * n_seq)
    itemsize = dtype.itemsize
    expected_bin = int(pointers[-1]) + int(lengths[-1]) * itemsize if n_seq else 0
    if bin_size != expected_bin:
        raise SourceDataError(
            str(bin_path),
            f".bin is {bin_size} bytes, but its .idx ({str(idx_path).rsplit('/', 1)[-1]}) says {expected_bin} "
            f"({n_seq} sequences of {dtype.name})",
            hint="the .bin and .idx do not belong together or one is truncated; rebuild the pair",
        )
    if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or bool(np.any(np.diff(docs) < 0)):
        raise SourceDataError(
            str(idx_path),
            f"corrupt .idx: document indices must rise from 0 to the sequence count {n_seq}",
            hint=rebuild,
        )
    return _Index(idx_path, bin_path, dtype, lengths, pointers, docs, bin_size, stamp)


def _check_part(index: _Index, lo: int, hi: int) -> None:
    """Lengths of sequences lo..hi are >= 0 and their pointers follow each other without gaps."""
    lengths = index.lengths[lo:hi]
    if len(lengths) and int(lengths.min()) < 0:
        i = lo + int(np.argmax(lengths < 0))
        raise SourceDataError(str(index.idx_path), "corrupt .idx: negative sequence length", row=i)
    end = min(hi + 1, index.num_sequences)
    ptr = index.pointers[lo:end]
    want = np.empty(len(ptr), dtype=np.int64)
    if len(ptr):
        want[0] = 0 if lo == 0 else ptr[0]
        np.cumsum(lengths[: len(ptr) - 1].astype(np.int64) * index.dtype.itemsize, out=want[1:])
        want[1:] += want[0]
        bad = np.flatnonzero(ptr != want)
        if len(bad):
            raise SourceDataError(
                str(index.idx_path),
                f"corrupt .idx: sequence pointer {int(ptr[bad[0]])} does not follow the lengths "
                f"(expected {int(want[bad[0]])})",
                row=lo + int(bad[0]),
                hint="rebuild the pair with Megatron's preprocess_data.py",
            )


class MegatronReader(FormatReader):
    """Scans and reads Megatron .bin/.idx datasets; one sample per sequence, `row` = sequence index."""

    def __init__(self, source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> None:
        super().__init__(source, tokenizer, images)  # checks that `metadata` holds only DOCUMENT_COLUMN
        self._indexes: dict[Location, _Index] = {}
        self._bins: dict[Location, np.ndarray | _RemoteTokens] = {}
        self._opts = source.storage_options

    def _index(self, prefix: Location) -> _Index:
        """The parsed .idx of `prefix`, cached until either file's size or mtime changes (objects: parsed once)."""
        cached = self._indexes.get(prefix)
        if cached is not None and (is_url(prefix) or cached.stamp == _stamp(cached.idx_path, cached.bin_path)):
            return cached
        self._bins.pop(prefix, None)
        index = _parse_index(prefix, self._opts)
        self._indexes[prefix] = index
        return index

    def num_parts(self, path: Location, target_bytes: int) -> int:
        """Contiguous ranges of sequences, about `target_bytes` of .idx each (scans read only the .idx)."""
        index = self._index(path)
        by_bytes = -(-index.stamp[0] // max(int(target_bytes), 1))
        by_rows = max(index.num_sequences // _ROWS_PER_PART_MIN, 1)
        return int(max(1, min(by_bytes, by_rows)))

    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        if not 0 <= part < num_parts:
            raise ValueError(f"part {part} out of range for {num_parts} parts")
        index = self._index(path)
        n = index.num_sequences
        lo, hi = n * part // num_parts, n * (part + 1) // num_parts
        _check_part(index, lo, hi)
        rows = np.arange(lo, hi, dtype=np.uint64)
        columns: dict[str, pa.Array] = {
            "row": pa.array(rows, type=pa.uint64()),
            "num_tokens": pa.array(index.lengths[lo:hi].astype(np.uint32), type=pa.uint32()),
            "num_image_tokens": pa.array(np.zeros(hi - lo, dtype=np.uint32), type=pa.uint32()),
            "checksum": pa.array(self._checksums(path, index, lo, hi), type=pa.uint32()),
        }
        if DOCUMENT_COLUMN in self.source.metadata:
            doc = np.searchsorted(index.document_indices, rows.astype(np.int64), side="right") - 1
            columns[DOCUMENT_COLUMN] = pa.array(doc.astype(np.uint64), type=pa.uint64())
        return ScanResult(rows=pa.table(columns))

    def _checksums(self, path: Location, index: _Index, lo: int, hi: int) -> np.ndarray:
        """Checksums of sequences lo..hi, hashed from one slice of the memory-mapped .bin.

        `_check_part` has proved the sequences contiguous, so they are one slice, hashed in place in the .bin's
        dtype (`checksum_dtype`). Token ids outside int32 are left to `read` to reject.
        """
        if hi <= lo:
            return np.zeros(0, dtype=np.uint32)
        offsets = np.concatenate([[0], np.cumsum(index.lengths[lo:hi], dtype=np.int64)])
        first = int(index.pointers[lo]) // index.dtype.itemsize
        return checksums_flat(self._bin(path, index)[first : first + int(offsets[-1])], offsets)

    def _bin(self, path: Location, index: _Index) -> np.ndarray | _RemoteTokens:
        """The .bin as a read-only array of its dtype, memory-mapped once per file (an object: read by range)."""
        arr = self._bins.get(path)
        if arr is None:
            if index.bin_size == 0:
                arr = np.zeros(0, dtype=index.dtype)
            elif is_url(index.bin_path):
                arr = _RemoteTokens(str(index.bin_path), index.bin_size, index.dtype.newbyteorder("<"), self._opts)
            else:
                arr = np.memmap(index.bin_path, dtype=index.dtype.newbyteorder("<"), mode="r")
            self._bins[path] = arr
        return arr

    def checksum_dtype(self, path: Location) -> np.dtype:
        """The .bin's dtype (from the .idx header): its tokens are hashed as stored."""
        return self._index(path).dtype

    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        index = self._index(path)
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return []
        n = index.num_sequences
        out_of_range = (rows < 0) | (rows >= n)
        if out_of_range.any():
            bad = int(rows[out_of_range][0])
            raise SourceDataError(str(path), f"sequence out of range (dataset has {n})", row=bad, hint=_STALE)
        data = self._bin(path, index)
        lengths = index.lengths[rows].tolist()
        starts = (index.pointers[rows] // index.dtype.itemsize).tolist()
        # Per-sample slices of the memory map (one copy each) beat one flat fancy-index gather.
        views = [data[s : s + k] for s, k in zip(starts, lengths, strict=True)]
        if index.dtype not in _SAFE_DTYPES:  # ids could be negative or beyond int32
            for row, v in zip(rows.tolist(), views, strict=True):
                if len(v) and (int(v.min()) < 0 or int(v.max()) > _INT32_MAX):
                    why = f"token id outside [0, {_INT32_MAX}]"
                    raise SourceDataError(str(index.bin_path), why, row=row, hint="fix the tokenized data")
        tokens = [np.array(v, dtype=np.int32) for v in views]  # plain ndarrays: they get pickled
        return [Sample(tokens=t) for t in tokens]

    def close(self) -> None:
        self._bins.clear()
        self._indexes.clear()

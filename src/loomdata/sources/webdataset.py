"""WebDataset tar shards (as `webdataset.TarWriter` writes them): samples are runs of members by key.

WebDataset's rule: a member `dir/abc.seg.txt` has key `dir/abc` (the path up to the first dot of
the basename) and extension `seg.txt` (lower-cased); consecutive regular members with the same key
form one sample; directories, links and `__meta__` names are skipped. The source's `text_field`
names the text extension (required in every sample), `image_field` the image extensions (each
optional; a sample's images are taken in the order `image_field` lists them).

`row` is the byte offset of the header of a sample's first member, so `read` seeks there and parses
only that sample's members. Tar is sequential, so a shard is one part (`num_parts` is always 1);
only uncompressed tars are supported (byte offsets into a compressed stream cannot be sought).

The scan walks the 512-byte headers (seeking over member data), reads the text members to count
and checksum their tokens with the spec's tokenizer (one batched call per shard) and reads only the headers of
image members (Pillow's `Image.open` parses the header without decoding pixels) to count image
tokens by `images.image_tokens_array`. A sample's tokens are its image placeholders
(`ImageSpec.placeholder_token_id`, one per patch, images in order) followed by its text tokens.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.records import OnError
from loomdata.sources._base import FormatReader, Sample, ScanResult
from loomdata.sources._integrity import prefixed_checksums
from loomdata.sources.images import decode_image, decoded_image_tokens, image_tokens_array
from loomdata.sources.tokenizer import make_tokenizer
from loomdata.storage import Location, StorageOptions, identity, is_url, open_input

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = ["KEY_COLUMN", "WebDatasetReader"]

KEY_COLUMN = "__key__"
"""Metadata column holding each sample's key; any other metadata name is an extension carried as text."""

_BLOCK = tarfile.BLOCKSIZE
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_STALE = "the index is stale for this shard; re-run `loom index`"


@dataclass(slots=True)
class _RawSample:
    """One sample's members as found in the tar: key, first header offset, extension -> member."""

    key: str
    offset: int
    members: dict[str, tarfile.TarInfo] = field(default_factory=dict)
    problem: str | None = None  # set when the grouping itself is broken (duplicate member)


@dataclass(slots=True)
class _Open:
    """An open shard: the file, a TarFile to parse headers with, its size and mtime (to detect rewrites)."""

    file: BinaryIO
    tar: tarfile.TarFile
    size: int
    mtime_ns: int


def _split_name(name: str) -> tuple[str, str] | None:
    """(key, lower-cased extension) of a member name, or None for members webdataset skips."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    if _META.match(name):
        return None
    m = _KEY_EXT.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2).lower()


def _open_shard(path: Location, options: StorageOptions | None = None) -> _Open:
    """Open `path` as an uncompressed tar (an object: headers by range reads); problems name the file."""
    try:
        ident = identity(path, options)
        f = open_input(path, options, size=ident.size)  # kept open by the reader until close()
    except OSError as e:
        raise SourceDataError(str(path), f"cannot open the tar shard ({e.strerror})") from None
    head = f.read(6)
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            f.close()
            raise SourceDataError(
                str(path),
                f"{kind}-compressed tar: samples are located by byte offset, which needs an uncompressed tar",
                hint="decompress the shard (it stays a valid WebDataset shard) and point `paths` at it",
            )
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115
    except (tarfile.TarError, EOFError, OSError) as e:
        f.close()
        raise SourceDataError(str(path), f"not a readable tar file ({e})") from None
    return _Open(f, tar, ident.size, ident.mtime_ns or zlib.crc32(ident.version.encode()))


def _members(shard: _Open, path: Location, start: int) -> Iterator[tarfile.TarInfo]:
    """Headers from byte `start` to the end-of-archive marker; truncation and corruption raise."""
    pos = start
    f = shard.file
    while True:
        f.seek(pos)
        block = f.read(_BLOCK)
        if len(block) < _BLOCK:
            raise SourceDataError(
                str(path),
                f"truncated tar: {'no end-of-archive marker' if not block else 'partial header'} at byte {pos}",
                hint="the file was cut short; rewrite or re-download it, or set `on_error: skip`",
            )
        if block.count(0) == _BLOCK:
            return
        f.seek(pos)
        try:
            ti = tarfile.TarInfo.fromtarfile(shard.tar)
        except (tarfile.TarError, EOFError, UnicodeError, ValueError) as e:
            raise SourceDataError(str(path), f"corrupt tar header at byte {pos} ({e})") from None
        end = ti.offset_data + (ti.size if ti.isreg() else 0)
        if end > shard.size:
            raise SourceDataError(
                str(path),
                f"truncated tar: member {ti.name!r} at byte {ti.offset} needs {end} bytes, the file has {shard.size}",
                hint="the file was cut short; rewrite or re-download it, or set `on_error: skip`",
            )
        yield ti
        pos = shard.tar.offset


def _samples(shard: _Open, path: Location, start: int = 0, *, first_only: bool = False) -> Iterator[_RawSample]:
    """Group members into samples by key, the way webdataset's `group_by_keys` does."""
    cur: _RawSample | None = None
    for ti in _members(shard, path, start):
        if not ti.isreg():
            continue
        split = _split_name(ti.name)
        if split is None:
            continue
        key, ext = split
        if cur is None or key != cur.key:
            if cur is not None:
                yield cur
                if first_only:
                    return
            cur = _RawSample(key, ti.offset)
        if ext in cur.members:
            cur.problem = cur.problem or f"duplicate member {ti.name!r}"
        else:
            cur.members[ext] = ti
    if cur is not None:
        yield cur


def _payload(shard: _Open, ti: tarfile.TarInfo) -> bytes:
    shard.file.seek(ti.offset_data)
    return shard.file.read(ti.size)


class WebDatasetReader(FormatReader):
    """Scans and reads WebDataset tar shards; one sample per key run, `row` = its first header's offset."""

    thread_safe = True  # every entry point holds `_lock`

    def __init__(self, source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> None:
        super().__init__(source, tokenizer, images)  # checks that `text_field` is set
        self._text = (source.text_field or "").lower()
        self._images = [e.lower() for e in source.image_field]
        self._shards: dict[Location, _Open] = {}
        self._lock = threading.Lock()  # open shards share one file position: one caller at a time

    def _shard(self, path: Location) -> _Open:
        """The open shard, reopened when the file changed since it was opened."""
        shard = self._shards.get(path)
        if shard is not None and is_url(path):
            return shard  # an object is checked once, when opened (a HEAD per read would cost a round trip)
        if shard is not None:
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is not None and (st.st_size, st.st_mtime_ns) == (shard.size, shard.mtime_ns):
                return shard
            shard.tar.close()
            shard.file.close()
            del self._shards[path]
        shard = _open_shard(path, self.source.storage_options)
        self._shards[path] = shard
        return shard

    def num_parts(self, path: Location, target_bytes: int) -> int:
        """Always 1: tar headers can only be found by walking the file from its start."""
        return 1

    def _problem(self, sample: _RawSample) -> str | None:
        """Why `sample` cannot be used, or None (grouping problems and a missing text member)."""
        if sample.problem is not None:
            return sample.problem
        if self._text not in sample.members:
            have = ", ".join(sorted(sample.members)) or "none"
            return f"no .{self._text} member (text_field); members: {have}"
        return None

    def _fail(self, path: Location, sample: _RawSample, why: str, errors: list[tuple[int | None, str]]) -> None:
        msg = f"sample {sample.key!r} at byte {sample.offset}: {why}"
        if self.source.on_error is OnError.ERROR:
            raise SourceDataError(str(path), msg, row=sample.offset)
        errors.append((sample.offset, msg))

    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        if (part, num_parts) != (0, 1):
            raise ValueError(f"a tar shard is one part; got part {part} of {num_parts}")
        with self._lock:
            return self._scan(path)

    def _scan(self, path: Location) -> ScanResult:
        from PIL import Image

        shard = self._shard(path)
        errors: list[tuple[int | None, str]] = []
        rows: list[int] = []
        texts: list[str] = []
        img_owner: list[int] = []  # index into rows, per image
        widths: list[int] = []
        heights: list[int] = []
        meta: dict[str, list[str | None]] = {m: [] for m in self.source.metadata}
        for s in _samples(shard, path):
            why = self._problem(s)
            text = ""
            sizes: list[tuple[int, int]] = []
            values: dict[str, str | None] = {}
            if why is None:
                try:
                    text = _payload(shard, s.members[self._text]).decode("utf-8")
                except UnicodeDecodeError as e:
                    why = f".{self._text} member is not UTF-8 text ({e})"
            for ext in self._images:
                if why is not None or ext not in s.members:
                    continue
                try:
                    fh = shard.tar.extractfile(s.members[ext])  # lazy: Pillow reads only the header
                    if fh is None:
                        raise ValueError("not a regular file")
                    with Image.open(fh) as im:
                        sizes.append(im.size)
                except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
                    why = f".{ext} member is not a readable image ({type(e).__name__}: {e})"
            for m in self.source.metadata:
                if why is not None:
                    break
                if m == KEY_COLUMN:
                    values[m] = s.key
                elif m in s.members:
                    try:
                        values[m] = _payload(shard, s.members[m]).decode("utf-8")
                    except UnicodeDecodeError:
                        why = f".{m} member (metadata) is not UTF-8 text"
                else:
                    values[m] = None
            if why is not None:
                self._fail(path, s, why, errors)
                continue
            for w, h in sizes:
                img_owner.append(len(rows))
                widths.append(w)
                heights.append(h)
            rows.append(s.offset)
            texts.append(text)
            for m in self.source.metadata:
                meta[m].append(values[m])
        encoded = make_tokenizer(self.tokenizer_spec).encode_batch(texts)
        text_tokens = np.fromiter((len(t) for t in encoded), dtype=np.uint64, count=len(encoded))
        per_image = image_tokens_array(np.array(widths, dtype=np.int64), np.array(heights, dtype=np.int64), self.images)
        img_tokens = np.bincount(np.array(img_owner, dtype=np.int64), weights=per_image, minlength=len(rows))
        img_tokens = img_tokens.astype(np.uint64)
        total = text_tokens + img_tokens
        if len(total) and int(total.max()) > np.iinfo(np.uint32).max:
            i = int(np.argmax(total))
            raise SourceDataError(str(path), "sample has more than 2**32-1 tokens", row=rows[i])
        columns: dict[str, pa.Array] = {
            "row": pa.array(np.array(rows, dtype=np.uint64), type=pa.uint64()),
            "num_tokens": pa.array(total.astype(np.uint32), type=pa.uint32()),
            "num_image_tokens": pa.array(img_tokens.astype(np.uint32), type=pa.uint32()),
            "checksum": pa.array(
                prefixed_checksums(self.images.placeholder_token_id, img_tokens.astype(np.int64), encoded),
                type=pa.uint32(),
            ),
        }
        for m in self.source.metadata:
            columns[m] = pa.array(meta[m], type=pa.string())
        return ScanResult(rows=pa.table(columns), errors=errors)

    def _sample_at(self, path: Location, shard: _Open, row: int) -> _RawSample:
        """The sample whose first member header is at byte `row`."""
        if row < 0 or row % _BLOCK or row >= shard.size:
            raise SourceDataError(str(path), "not a member header offset", row=row, hint=_STALE)
        try:
            sample = next(_samples(shard, path, row, first_only=True), None)
        except SourceDataError as e:
            raise SourceDataError(str(path), e.reason, row=row, hint=_STALE) from None
        if sample is None or sample.offset != row:
            raise SourceDataError(str(path), "no sample starts at this offset", row=row, hint=_STALE)
        why = self._problem(sample)
        if why is not None:
            raise SourceDataError(str(path), f"sample {sample.key!r}: {why}", row=row, hint=_STALE)
        return sample

    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        rows_list = [int(r) for r in np.asarray(rows, dtype=np.int64)]
        if not rows_list:
            return []
        with self._lock:
            shard = self._shard(path)
            found = {r: self._sample_at(path, shard, r) for r in dict.fromkeys(rows_list)}
            texts: list[str] = []
            for r in rows_list:
                s = found[r]
                try:
                    texts.append(_payload(shard, s.members[self._text]).decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise SourceDataError(str(path), f"sample {s.key!r}: text is not UTF-8 ({e})", row=r) from None
            payloads = {
                r: [(s.members[ext].name, _payload(shard, s.members[ext])) for ext in self._images if ext in s.members]
                for r, s in found.items()
            }
        encoded = make_tokenizer(self.tokenizer_spec).encode_batch(texts)
        p = self.images.patch_size
        out: list[Sample] = []
        for r, text_tokens in zip(rows_list, encoded, strict=True):
            images = [decode_image(data, self.images, name=f"{path}:{name}") for name, data in payloads[r]]
            n_img = sum(decoded_image_tokens(im, p) for im in images)
            tokens = np.empty(n_img + len(text_tokens), dtype=np.int32)
            tokens[:n_img] = self.images.placeholder_token_id
            tokens[n_img:] = text_tokens
            out.append(Sample(tokens=tokens, images=images))
        return out

    def close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.tar.close()
                shard.file.close()
            self._shards.clear()

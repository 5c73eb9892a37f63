"""Writers of source formats, for tests, benchmarks and demos (the readers in `loomdata.sources` only read).

Each writer produces exactly what the format's own library writes, deterministically, so tests can
build shards without that library and the seeded corpus is byte-identical across runs:

- `write_megatron`: a Megatron `PREFIX.bin` / `PREFIX.idx` pair, byte-equal to megatron-core's
  `IndexedDatasetBuilder` (the .idx layout is the one `loomdata.sources.megatron` reads);
- `write_webdataset_shard`: an uncompressed WebDataset tar shard like `webdataset.TarWriter`'s.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from loomdata.sources.megatron import DTYPE_CODES, IDX_HEADER, IDX_MAGIC, IDX_VERSION
from loomdata.sources.webdataset import KEY_COLUMN

__all__ = ["write_megatron", "write_webdataset_shard"]


def write_megatron(prefix: Path, docs: Iterable[np.ndarray], dtype: type[np.integer] | np.dtype = np.uint16) -> int:
    """Write `docs` as PREFIX.bin/PREFIX.idx, one sequence per document; returns the document count.

    The bytes equal what megatron-core's `IndexedDatasetBuilder(bin, dtype)` writes for
    `add_item(doc); end_document()` per document, then `finalize(idx)`. Token ids must fit `dtype`
    (ValueError otherwise, instead of wrapping around). Files appear atomically (temp name, rename).
    """
    dt = np.dtype(dtype)
    code = next((c for c, d in DTYPE_CODES.items() if d == dt), None)
    if code is None:
        names = ", ".join(sorted(d.name for d in DTYPE_CODES.values()))
        raise ValueError(f"unsupported Megatron token dtype {dt.name} (supported: {names})")
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    tmp_bin, tmp_idx = Path(f"{bin_path}.tmp"), Path(f"{idx_path}.tmp")
    info = np.iinfo(dt)
    lengths: list[int] = []
    try:
        with open(tmp_bin, "wb") as f:
            for i, doc in enumerate(docs):
                arr = np.asarray(doc)
                if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                    raise ValueError(f"document {i}: expected a 1-D integer array, got {arr.dtype}{list(arr.shape)}")
                if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
                    raise ValueError(f"document {i}: token ids outside the range of {dt.name}")
                f.write(arr.astype(dt.newbyteorder("<"), copy=False).tobytes())
                lengths.append(int(arr.size))
        n = len(lengths)
        lens = np.asarray(lengths, dtype="<i4")
        pointers = np.zeros(n, dtype="<i8")
        if n > 1:
            np.cumsum(lens[:-1].astype(np.int64) * dt.itemsize, out=pointers[1:])
        doc_indices = np.arange(n + 1, dtype="<i8")
        with open(tmp_idx, "wb") as f:
            f.write(IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, code, n, n + 1))
            f.write(lens.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return n


def _as_bytes(value: object, where: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{where}: payload must be bytes or str, got {type(value).__name__}")


def write_webdataset_shard(path: Path, samples: Iterable[Mapping[str, bytes | str]]) -> int:
    """Write `samples` (each `{"__key__": key, ext: payload, ...}`) as an uncompressed tar shard.

    Members are `key.ext` in sorted extension order, like `webdataset.TarWriter`, with fixed mtime,
    mode and owner so the same samples give byte-identical files. Returns the number of samples.
    Keys must be non-empty, without a dot in their basename, and differ from the previous sample's
    key (otherwise WebDataset would group members differently); extensions must not start with `_`.
    The file appears atomically (temp name, rename).
    """
    tmp = Path(f"{path}.tmp")
    n = 0
    prev: str | None = None
    try:
        with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i, sample in enumerate(samples):
                key = sample.get(KEY_COLUMN)
                if not isinstance(key, str) or not key or "." in key.rsplit("/", 1)[-1] or key.endswith("/"):
                    raise ValueError(f"sample {i}: `__key__` must be a non-empty str without '.' in its basename")
                if key == prev:
                    raise ValueError(f"sample {i}: key {key!r} repeats the previous sample's key")
                exts = sorted(k for k in sample if k != KEY_COLUMN)
                if not exts:
                    raise ValueError(f"sample {i} ({key!r}): no members besides `__key__`")
                for ext in exts:
                    if ext.startswith("_") or "/" in ext or ext != ext.strip():
                        raise ValueError(f"sample {i} ({key!r}): bad extension {ext!r}")
                    data = _as_bytes(sample[ext], f"sample {i} ({key!r}) .{ext}")
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    ti.mtime = 0
                    ti.mode = 0o444
                    ti.uname = ti.gname = "bigdata"
                    tar.addfile(ti, io.BytesIO(data))
                prev = key
                n += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n

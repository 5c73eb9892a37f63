"""The I/O-aware block shuffle of a source's stream, and the figures that say what a shuffle costs and gives.

Storage order. Index rows are in (shard, row) order (`loom index` writes them so), so a run of consecutive
index rows with the same shard is a run of neighbours in one file. A *block* is `block_size` consecutive
documents of one such run (the last block of a run may be shorter; a block never spans two shards).

Block shuffle (spec `shuffle: block`, as Mosaic Streaming's py1b): every epoch, from the source's seeded
generator (seed, crc32(name), epoch), the order of all blocks is permuted, the permuted order is cut into
windows of `window` consecutive blocks, and the documents of each window are shuffled among themselves.
So every document is drawn exactly once per epoch, and the documents of one window come from `window`
blocks only: a loader that fetches whole blocks and keeps the last `window` of them reads each block
once per epoch, sequentially inside it. NumPy throughout: one block permutation, one repeat, one stable
argsort of (window, random key) per epoch; no per-document Python.

Figures (ShuffleFigures, in the plan summary under `shuffle`), measured on the stream prefix the plan
draws (at most its first FIGURE_SEGMENTS segments), where p[i] is the storage position (index row) of
the document of the plan's i-th segment of the source:
- `spearman`: Spearman rank correlation between plan position i and p[i]; near 0 means no trend with
  file order (both shuffles), near 1 means the plan reads the files front to back.
- `mean_jump_docs`: mean |p[i+1] - p[i]|, how far consecutive planned documents lie apart in storage;
  `mean_jump_share` is it over the source's documents (about 1/3 for a global shuffle).
- `read_amplification`: bytes fetched per byte delivered by a reader that fetches whole blocks (the
  source's own blocks under `shuffle: block`, blocks of the default size for `global`) into an LRU cache
  of `window` blocks (its memory): a segment whose block is not cached costs the whole block. Bytes are
  estimated as tokens (a document's bytes are about proportional to its tokens; exact for Megatron
  .bin). A block shuffle gives about 1.0 (each block fetched once per epoch); a global shuffle about
  (1 - window / blocks) x a block's bytes per document's.
- `fetches_per_segment`: block fetches of that reader per segment delivered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loomdata.planning._shuffle_kernel import block_reads, stable_ranks
from loomdata.schemas.spec import SourceSpec

__all__ = [
    "FIGURE_SEGMENTS",
    "BlockLayout",
    "ShuffleFigures",
    "layout_of",
    "shuffle_figures",
    "storage_runs",
]

FIGURE_SEGMENTS = 1 << 16
"""The shuffle figures are measured on at most this many first segments of a source's stream (bounds their cost)."""
RANK_COUNTING = 4
"""The Spearman ranks come from a counting sort (_shuffle_kernel.stable_ranks) where the storage positions span
at most this many times the segments measured (its counts array stays that small), else from NumPy's argsort."""


def storage_runs(shard: np.ndarray, row: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(run starts (int64, with n appended), order) of index rows by shard: runs of one shard, consecutive in
    storage. `order` is None when the rows are in (shard, row) order already (as `loom index` writes them),
    else the index rows in storage order (hand-made tables)."""
    n = len(shard)
    shard = np.asarray(shard)
    order: np.ndarray | None = None
    if n > 1 and row is not None:
        ds = np.diff(shard.astype(np.int64))
        dr = np.diff(np.asarray(row).astype(np.int64))
        if ((ds < 0) | ((ds == 0) & (dr < 0))).any():
            order = np.lexsort((row, shard)).astype(np.int64)
            shard = shard[order]
    change = np.flatnonzero(shard[1:] != shard[:-1]) + 1 if n > 1 else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], change, [n]]).astype(np.int64) if n else np.zeros(1, dtype=np.int64)
    return starts, order


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """A source's blocks: block b holds storage positions starts[b]:starts[b+1]; `order` maps positions to
    index rows (None: the same), `window` blocks are shuffled together."""

    starts: np.ndarray  # int64, num_blocks + 1
    order: np.ndarray | None
    block_size: int
    window: int

    @classmethod
    def of(cls, runs: np.ndarray, order: np.ndarray | None, block_size: int, window: int) -> BlockLayout:
        """Cut every run of one shard (storage_runs) into blocks of `block_size` documents."""
        if block_size < 1 or window < 1:
            raise ValueError(f"block_size and window must be >= 1, got {block_size} and {window}")
        lens = np.diff(runs)
        nblk = -(-lens // block_size)  # ceil; 0 for an empty run
        run_of = np.repeat(np.arange(len(lens)), nblk)
        first = np.cumsum(nblk) - nblk
        k = np.arange(int(nblk.sum()), dtype=np.int64) - first[run_of]
        starts = np.concatenate([runs[:-1][run_of] + k * block_size, runs[-1:]]).astype(np.int64)
        return cls(starts, order, block_size, window)

    @property
    def num_docs(self) -> int:
        return int(self.starts[-1])

    @property
    def num_blocks(self) -> int:
        return len(self.starts) - 1

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """Storage positions (int64) of index rows."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.order is None:
            return rows
        inv = np.empty(len(self.order), dtype=np.int64)
        inv[self.order] = np.arange(len(self.order), dtype=np.int64)
        return inv[rows]

    def permutation(self, rng: np.random.Generator) -> np.ndarray:
        """One epoch's order of all index rows (int64): blocks permuted, documents shuffled within windows."""
        n, nb = self.num_docs, self.num_blocks
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        sizes = np.diff(self.starts)
        bperm = rng.permutation(nb)
        sz = sizes[bperm]
        out_first = np.cumsum(sz) - sz
        pos = np.arange(n, dtype=np.int64) + np.repeat(self.starts[bperm] - out_first, sz)
        win = np.repeat(np.arange(nb, dtype=np.uint64) // np.uint64(self.window), sz)
        key = (win << np.uint64(32)) | rng.integers(0, 1 << 32, size=n, dtype=np.uint64)
        del win
        pos = pos[np.argsort(key, kind="stable")]
        return pos if self.order is None else self.order[pos]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShuffleFigures:
    """What a source's shuffle gives (no trend with storage order) and costs (reads); see the module doc."""

    mode: str
    block_size: int
    window: int
    segments: int  # measured on this many first segments
    spearman: float
    mean_jump_docs: float
    mean_jump_share: float
    read_amplification: float
    fetches_per_segment: float

    def to_dict(self) -> dict[str, float | int | str]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def shuffle_figures(
    source: SourceSpec,
    layout: BlockLayout,
    doc: np.ndarray,
    length: np.ndarray | None,
    lengths: np.ndarray,
    *,
    tokens: int | None = None,
) -> ShuffleFigures:
    """Figures of the segments (`doc` index rows, `length` tokens) a plan draws from `source` over `layout`
    (the source's blocks; for a global shuffle, blocks of the default size); `lengths` are its documents'
    tokens by index row. `tokens` instead of `length`: the measured segments' tokens summed (the first
    min(len(doc), FIGURE_SEGMENTS) of them: a stream's cumulative count there), so no lengths are gathered."""
    m = min(len(doc), FIGURE_SEGMENTS)
    p = layout.positions(doc[:m])
    if tokens is None:
        if length is None:
            raise ValueError("shuffle_figures needs the segments' `length` or their `tokens`")
        tokens = int(np.asarray(length[:m]).sum(dtype=np.int64))
    seg_len_total = int(tokens)  # < 2**53: its float64 sum, exactly
    spearman = 0.0
    if m > 2:
        hi = int(p.max()) + 1
        if int(p.min()) >= 0 and hi <= RANK_COUNTING * m:  # few documents (many sources): a counting sort
            rank = stable_ranks(p, hi)
        else:
            rank = np.empty(m, dtype=np.float64)
            rank[np.argsort(p, kind="stable")] = np.arange(m, dtype=np.float64)
        c = np.corrcoef(np.arange(m, dtype=np.float64), rank)[0, 1]
        spearman = float(c) if np.isfinite(c) else 0.0
    jump = amp = fetch = 0.0
    if m:
        # one compiled pass (the jumps, each position's block, the LRU replay, the fetched blocks' tokens); its
        # integer sums are float64 sums of the same values, exact below 2**53 (every partial sum exact)
        order = np.zeros(0, dtype=np.int64) if layout.order is None else layout.order
        misses, fetched, jumps = block_reads(
            np.ascontiguousarray(p, dtype=np.int64),
            layout.starts,
            int(layout.block_size),
            int(layout.window),
            lengths,
            order,
        )
        jump = jumps / (m - 1) if m > 1 else 0.0
        fetch = misses / m
        amp = float(fetched / max(float(seg_len_total), 1.0))
    return ShuffleFigures(
        mode=source.shuffle.value,
        block_size=layout.block_size,
        window=layout.window,
        segments=m,
        spearman=spearman,
        mean_jump_docs=jump,
        mean_jump_share=jump / max(layout.num_docs, 1),
        read_amplification=amp,
        fetches_per_segment=fetch,
    )


def layout_of(source: SourceSpec, runs: np.ndarray, order: np.ndarray | None) -> BlockLayout:
    """The source's block layout: its own blocks under `shuffle: block`, default-size reference blocks else."""
    block_size, window = source.shuffle_blocks or (SourceSpec.BLOCK_SIZE_DEFAULT, SourceSpec.WINDOW_DEFAULT)
    return BlockLayout.of(runs, order, block_size, window)

"""`pack_step` (one search and one segments array per step) against the per-batch reference it replaced,
and `pack_group` (a build group in one pass, into one block) against `pack_step`; `pack_joined` (answers for the
group's rows end to end, requests spanning steps, as serving reads them) against `pack_group`.

Random steps: several ranks and micro-batches, empty micro-batches, zero-length segments, two lanes,
images spread over several loader answers; every array of every batch must be equal, dtypes included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loomdata.execution._loader import SegmentData
from loomdata.execution._manifest import ManifestRows
from loomdata.execution._pack_group import StepPack, block_of, pack_joined
from loomdata.execution._packing import PackRules, pack_batch, pack_step, scatter_answers
from loomdata.schemas.batch import SEGMENT_DTYPE, Batch, BatchBlock
from loomtest.manifest_rows import PackMeta, rows_of
from loomtest.pack_group import pack_group


def _reference(
    meta: Any,
    rules: PackRules,
    step: int,
    ranks: list[int],
    rows: ManifestRows,
    groups: list[np.ndarray],
    answers: list[SegmentData],
) -> dict[int, list[Batch]]:
    """The per-batch construction pack_step replaced (a search and a segments array per micro-batch)."""
    starts, flat, images, all_img_row, all_img_off = scatter_answers(rows, groups, answers)
    mbs = meta.micro_batches
    key = rows.dp_rank.astype(np.int64) * mbs + rows.micro_batch.astype(np.int64)
    out: dict[int, list[Batch]] = {}
    for r in ranks:
        batches = []
        for mb in range(mbs):
            lo, hi = (int(x) for x in np.searchsorted(key, [r * mbs + mb, r * mbs + mb + 1]))
            seg = np.empty(hi - lo, dtype=SEGMENT_DTYPE)
            seg["source"] = rows.source[lo:hi]
            seg["sample"] = rows.sample[lo:hi]
            seg["offset"] = rows.offset[lo:hi]
            seg["length"] = rows.length[lo:hi]
            lane = int(rows.lane[lo]) if hi > lo else 0
            in_mb = np.flatnonzero((all_img_row >= lo) & (all_img_row < hi))
            batches.append(
                pack_batch(
                    step=step,
                    dp_rank=r,
                    micro_batch=mb,
                    lane=lane,
                    seq_len=meta.lane_seq_len(lane),
                    segments=seg,
                    tokens=flat[starts[lo] : starts[hi]],
                    pad_token_id=rules.pad_token_id,
                    images=[images[k] for k in in_mb.tolist()],
                    image_positions=(starts[all_img_row[in_mb]] - starts[lo] + all_img_off[in_mb]),
                    image_token_id=rules.image_token_id,
                )
            )
        out[r] = batches
    return out


def _step(
    rng: np.random.Generator, ranks: list[int], mbs: int, lanes: tuple[int, ...], step: int = 3, images: bool = True
) -> tuple[Any, ...]:
    cols: dict[str, list[int]] = {c: [] for c in ("dp_rank", "micro_batch", "length", "lane")}
    for r in ranks:
        for mb in range(mbs):
            lane = int(rng.integers(0, len(lanes)))
            n = int(rng.integers(0, 4))  # 0: an empty micro-batch
            lens = rng.integers(0, lanes[lane] // 4 + 1, size=n)
            for ln in lens.tolist():
                cols["dp_rank"].append(r)
                cols["micro_batch"].append(mb)
                cols["length"].append(ln)
                cols["lane"].append(lane)
    m = len(cols["length"])
    rows = rows_of(cols, step, rng)
    order = rng.permutation(m)
    groups = [np.sort(g) for g in np.array_split(order, 2)]  # two loaders, each answering some rows
    if rng.random() < 0.4:  # or each a run of consecutive rows (a slice copy in scatter_answers)
        groups = [g for g in np.array_split(np.arange(m), 2) if len(g)] or [np.arange(m)]
    answers = []
    for g in groups:
        lens = rows.length[g].astype(np.int64)
        tokens = rng.integers(1, 1000, size=int(lens.sum()), dtype=np.int32)
        with_img = [k for k in range(len(g)) if lens[k] > 0 and rng.random() < 0.3 and images]
        answers.append(
            SegmentData(
                tokens=tokens,
                images=[np.full((2, 2, 3), k, dtype=np.uint8) for k in with_img],
                image_segment=np.array(with_img, dtype=np.int32),
                image_offset=np.array([int(rng.integers(0, lens[k])) for k in with_img], dtype=np.int32),
            )
        )
    return rows, groups, answers


def _same(a: Batch, b: Batch) -> None:
    assert (a.step, a.dp_rank, a.micro_batch, a.lane) == (b.step, b.dp_rank, b.micro_batch, b.lane)
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert len(a.images) == len(b.images) and all(np.array_equal(x, y) for x, y in zip(a.images, b.images, strict=True))


@pytest.mark.parametrize("seed", range(10))
def test_pack_step_equals_the_per_batch_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks = sorted(rng.choice(8, size=int(rng.integers(1, 4)), replace=False).tolist())
    meta = PackMeta(micro_batches=int(rng.integers(1, 4)), lanes=(64, 128))
    rules = PackRules(pad_token_id=0, image_token_id=7)
    rows, groups, answers = _step(rng, ranks, meta.micro_batches, meta.lanes)
    got = pack_step(meta, rules, 3, ranks, rows, groups, answers)  # type: ignore[arg-type]
    want = _reference(meta, rules, 3, ranks, rows, groups, answers)
    assert sorted(got) == sorted(want) == ranks
    for r in ranks:
        assert len(got[r]) == len(want[r]) == meta.micro_batches
        for a, b in zip(got[r], want[r], strict=True):
            _same(a, b)


def _group(rng: np.random.Generator, meta: Any, first_step: int, images: bool) -> tuple[Any, ...]:
    """A build group: 1-5 consecutive steps, each for a random non-empty subset of ranks 0..3."""
    work, rows, answers = [], [], []
    for step in range(first_step, first_step + int(rng.integers(1, 6))):
        ranks = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
        r, g, a = _step(rng, ranks, meta.micro_batches, meta.lanes, step=step, images=images)
        work.append((step, ranks))
        rows.append(r)
        answers.append((g, a))
    return work, rows, answers


@pytest.mark.parametrize("seed", range(12))
def test_pack_group_equals_pack_step_and_its_blocks_equal_batchblock_of(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    meta = PackMeta(micro_batches=int(rng.integers(1, 4)), lanes=(64, 128))
    rules = PackRules(pad_token_id=5, image_token_id=7)
    held: dict[int, dict[int, StepPack]] = {}  # step -> rank -> pack, over two groups
    step = 0
    for images in (False, seed % 3 == 0):  # the second group has images in some seeds: pack_step's path
        work, rows, answers = _group(rng, meta, step, images)
        got = pack_group(meta, rules, work, rows, answers)  # type: ignore[arg-type]
        for (st, ranks), rw, (g, a), packs in zip(work, rows, answers, got, strict=True):
            want = pack_step(meta, rules, st, ranks, rw, g, a)  # type: ignore[arg-type]
            assert sorted(packs) == ranks
            for r in ranks:
                assert len(packs[r]) == meta.micro_batches
                for x, y in zip(packs[r].batches, want[r], strict=True):
                    _same(x, y)
            held[st] = packs
        step = work[-1][0] + 1
    for r in range(4):  # each rank's consecutive held steps, within a group and across both
        steps = sorted(st for st in held if r in held[st])
        for lo in range(len(steps)):
            run = [held[st][r] for st in steps[lo : lo + 4] if st - steps[lo] < 4]
            got_block, want_block = block_of(run), BatchBlock.of([p.batches for p in run])
            assert got_block.steps.tolist() == want_block.steps.tolist()
            one = run[0].block
            if one is not None and all(p.block is one for p in run):  # one group: a view of its block, no copy
                assert np.shares_memory(got_block.arrays["input_ids"], one.arrays["input_ids"])
            for xs, ys in zip(got_block.unpack(), want_block.unpack(), strict=True):
                for x, y in zip(xs, ys, strict=True):
                    _same(x, y)


@pytest.mark.parametrize("seed", range(4))
def test_pack_group_pads_rows_no_answer_covers(seed: int) -> None:
    """A row no loader answered (never in serving) is padding in the block, as before the views join; the rest is
    placed as with every answer (the join's fallback)."""
    rng = np.random.default_rng(300 + seed)
    meta = PackMeta(micro_batches=2, lanes=(64, 128))
    rules = PackRules(pad_token_id=5, image_token_id=7)
    work, rows, answers = _group(rng, meta, 0, images=False)
    full = pack_group(meta, rules, work, rows, answers)  # type: ignore[arg-type]
    cut = [(g[:1], a[:1]) for g, a in answers]  # each step's second loader never answered
    got = pack_group(meta, rules, work, rows, cut)  # type: ignore[arg-type]
    for (_, ranks), rw, (g, _), a, b in zip(work, rows, answers, full, got, strict=True):
        missing = set(np.concatenate(g[1:]).tolist()) if len(g) > 1 else set()
        for r in ranks:
            for x, y in zip(a[r].batches, b[r].batches, strict=True):
                seg = x.segments
                keep = np.ones(len(x.input_ids), dtype=bool)
                at = np.concatenate([[0], np.cumsum(seg["length"].astype(np.int64))])
                for k in range(len(seg)):  # the rows of this batch that lost their answer: padding now
                    mine = np.flatnonzero(
                        (rw.sample == seg["sample"][k]) & (rw.offset == seg["offset"][k]) & (rw.dp_rank == r)
                    )
                    if len(mine) and int(mine[0]) in missing:
                        keep[at[k] : at[k + 1]] = False
                        assert (y.input_ids[at[k] : at[k + 1]] == rules.pad_token_id).all()
                assert np.array_equal(x.input_ids[keep], y.input_ids[keep])
                assert np.array_equal(x.position_ids, y.position_ids)
                assert np.array_equal(x.cu_seqlens, y.cu_seqlens)


def test_a_held_pack_made_for_a_peer_stays_thin() -> None:
    """`made` gives the batches `batches` gives, without keeping them (a CP peer's take must not turn the held step
    into three arrays a token, which `step_bytes` does not count); `batches` keeps them."""
    rng = np.random.default_rng(7)
    meta = PackMeta(micro_batches=2, lanes=(64, 128))
    rules = PackRules(pad_token_id=5, image_token_id=7)
    work, rows, answers = _group(rng, meta, 0, False)
    packs = pack_group(meta, rules, work, rows, answers)  # type: ignore[arg-type]
    pack = next(iter(packs[0].values()))
    assert pack.block is not None
    made = pack.made()
    assert pack._batches is None
    for x, y in zip(made, pack.batches, strict=True):
        _same(x, y)
    assert pack._batches is not None


def _spanning(rng: np.random.Generator, rows: list[Any], answers: list[Any]) -> tuple[Any, ...]:
    """The group's answers as serving reads them: two requests over the steps' rows end to end (each row to one of
    them at random, ascending across the steps), their tokens and images moved with their rows."""
    row_tokens: list[np.ndarray] = []
    row_images: list[list[tuple[np.ndarray, int]]] = []  # each row's (image, offset in the row)
    for rw, (groups, datas) in zip(rows, answers, strict=True):
        toks: list[np.ndarray] = [np.zeros(0, dtype=np.int32)] * len(rw)
        imgs: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(len(rw))]
        for sel, data in zip(groups, datas, strict=True):
            at = np.concatenate([[0], np.cumsum(rw.length[sel].astype(np.int64))])
            for j, row in enumerate(sel.tolist()):
                toks[row] = data.tokens[at[j] : at[j + 1]]
            for img, seg, off in zip(data.images, data.image_segment.tolist(), data.image_offset.tolist(), strict=True):
                imgs[int(sel[seg])].append((img, off))
        row_tokens.extend(toks)
        row_images.extend(imgs)
    n = len(row_tokens)
    which = rng.integers(0, 2, size=n)
    groups, datas = [], []
    for w in (0, 1):
        sel = np.flatnonzero(which == w)
        if not len(sel):
            continue
        pairs = [(j, img, off) for j, row in enumerate(sel.tolist()) for img, off in row_images[row]]
        groups.append(sel)
        datas.append(
            SegmentData(
                tokens=np.concatenate([row_tokens[row] for row in sel.tolist()]).astype(np.int32),
                images=[img for _, img, _ in pairs],
                image_segment=np.array([j for j, _, _ in pairs], dtype=np.int32),
                image_offset=np.array([off for _, _, off in pairs], dtype=np.int32),
            )
        )
    return groups, datas


@pytest.mark.parametrize("seed", range(10))
def test_pack_joined_of_requests_spanning_steps_equals_pack_group(seed: int) -> None:
    """Serving packs a group from one answer per (source, partition) for all its steps, never cut per step (the cut
    was the constructor's largest term on long plans): the same batches as each step's own answers give."""
    rng = np.random.default_rng(500 + seed)
    meta = PackMeta(micro_batches=int(rng.integers(1, 4)), lanes=(64, 128))
    rules = PackRules(pad_token_id=5, image_token_id=7)
    work, rows, answers = _group(rng, meta, 0, images=seed % 3 == 0)  # images: pack_step's path, cut per step
    want = pack_group(meta, rules, work, rows, answers)  # type: ignore[arg-type]
    bounds = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    both = ManifestRows.concat(rows)
    got = pack_joined(meta, rules, work, both, bounds, _spanning(rng, rows, answers))  # type: ignore[arg-type]
    assert len(got) == len(want) == len(work)
    for (_, ranks), g, w in zip(work, got, want, strict=True):
        assert sorted(g) == sorted(w) == ranks
        for r in ranks:
            assert (g[r].block is None) == (w[r].block is None)
            for x, y in zip(g[r].batches, w[r].batches, strict=True):
                _same(x, y)

"""`UnitUses` and `UnitRows` merge chunks in place (session 26; session 27: `UnitUses` per key, the pairs served to
none named to `UnitRows.prune`; session 28: packed, `UnitRows` in a held run and a tail): every answer equals a plain
reference's, rebuilt from scratch (dicts and lists), over random plan / serve / prune sequences as `PlanUnitCache`
makes them."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.execution._loader_cache import FEW_READS, CachePolicy, PlanUnitCache, UnitRows, UnitUses, unit_key


class _RefUses:
    """Reads left per (key, step), in a dict; every answer computed from all of it."""

    def __init__(self, span: int) -> None:
        self.span = span
        self.left: dict[tuple[int, int], int] = {}

    def add(self, keys: np.ndarray, steps: np.ndarray) -> None:
        for k, s in zip(keys.tolist(), steps.tolist(), strict=True):
            self.left[(k, s)] = self.left.get((k, s), 0) + 1

    def consume(self, keys: np.ndarray, steps: np.ndarray) -> None:
        for k, s in zip(keys.tolist(), steps.tolist(), strict=True):
            if (k, s) in self.left:
                self.left[(k, s)] = max(self.left[(k, s)] - 1, 0)

    def get(self, keys: np.ndarray, steps: np.ndarray) -> list[int]:
        return [self.left.get((k, s), 0) for k, s in zip(keys.tolist(), steps.tolist(), strict=True)]

    def next_use(self, keys: np.ndarray, floor: int) -> list[int]:
        out = []
        for k in keys.tolist():
            mine = [s for (kk, s), n in self.left.items() if kk == k and n > 0 and s >= max(floor, 0)]
            out.append(min(mine) if mine else -1)
        return out

    def pending(self, lo: int, hi: int) -> tuple[list[int], list[int]]:
        first: dict[int, int] = {}
        for (k, s), n in self.left.items():
            if n > 0 and lo <= s <= hi:
                first[k] = min(first.get(k, s), s)
        pairs = sorted((s, k) for k, s in first.items())
        return [k for _, k in pairs], [s for s, _ in pairs]

    def prune(self, floor: int) -> None:
        self.left = {ks: n for ks, n in self.left.items() if ks[1] >= floor and n > 0}

    def __len__(self) -> int:
        return sum(1 for n in self.left.values() if n > 0)


def _ref_planned(triples: list[tuple[int, int, int]], uses: _RefUses, key: int, floor: int) -> tuple[list, list]:
    """A unit's planned (row, step) from `floor` on with a read left, in the order planned."""
    got = [(r, s) for k, s, r in triples if k == key and s >= floor and uses.left.get((k, s), 0) > 0]
    return [r for r, _ in got], [s for _, s in got]


@pytest.mark.parametrize("seed", range(12))
def test_merged_uses_and_rows_answer_as_a_reference_rebuilt_from_scratch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    span, chunk, n_keys = 400, 16, 24
    all_keys = unit_key(rng.integers(0, 6, n_keys), rng.integers(0, 2**20, n_keys))
    uses, rows, ref, triples = UnitUses(span), UnitRows(), _RefUses(span), []
    planned_to, newest, floor = 0, 0, 0
    for _ in range(120):
        op = rng.integers(0, 4)
        if op == 0 and planned_to < span:  # a chunk planned (out of order now and then: a read path's chunk)
            lo = planned_to if rng.random() < 0.8 else int(rng.integers(0, planned_to + 1))
            hi = min(lo + chunk, span)
            n = int(rng.integers(0, 60))
            k = rng.choice(all_keys[: int(rng.integers(1, n_keys + 1))], n)
            s = rng.integers(lo, hi, n) if hi > lo else np.zeros(0, dtype=np.int64)
            r = rng.integers(0, 50, len(s))
            uses.add(k, s)
            rows.add(k, s, r)
            ref.add(k, s)
            triples += list(zip(k.tolist(), s.tolist(), r.tolist(), strict=True))
            planned_to = max(planned_to, hi)
        elif op == 1 and ref.left:  # reads served: mostly planned pairs, some twice, some never planned
            pairs = list(ref.left)
            if rng.random() < 0.5:  # as serving does: every read of the next few steps, in step order
                first = min((s for (_, s), n in ref.left.items() if n > 0 and s >= newest), default=0)
                near = int(rng.choice([1, 2, 3, 40]))  # 40: a build group, more reads than `FEW_READS`
                pick = [p for p, n in ref.left.items() for _ in range(n) if first <= p[1] < first + near]
            else:
                pick = [pairs[i] for i in rng.integers(0, len(pairs), int(rng.choice([rng.integers(1, 40), 200])))]
            pick += [(int(all_keys[0]), span), (12345, 3), (int(all_keys[1]), -1)]
            k, s = (np.array(x, dtype=np.int64) for x in zip(*pick, strict=True))
            uses.consume(k, s)
            ref.consume(k, s)
            newest = max(newest, int(s[s < span].max()))
        elif op == 2:  # the floor moves (back too: a lagging rank asks) and both forget what is behind it
            floor = max(0, newest - int(rng.integers(0, 40)))
            if rng.random() < 0.5:
                uses.prune(floor)
                rows.prune(floor, uses)
            else:
                rows.prune(floor, uses)
                uses.prune(floor)
            ref.prune(floor)  # and the reads held as before: those behind the floor or with none left go
            triples = [t for t in triples if t[1] >= floor and ref.left.get((t[0], t[1]), 0) > 0]
            assert len(rows) == len(triples)
        q = rng.choice(np.concatenate([all_keys, [7, 12345]]), int(rng.integers(0, 12)))
        f = int(rng.integers(-5, span))
        assert uses.next_use(q, f).tolist() == ref.next_use(q, f)
        lo, hi = sorted(rng.integers(-5, span + 5, 2).tolist())
        got = uses.pending(lo, hi)
        assert (got[0].tolist(), got[1].tolist()) == ref.pending(lo, hi)
        qs = rng.integers(-1, span + 1, len(q))
        assert uses.left(q, qs).tolist() == ref.get(q, qs)
        assert len(uses) == len(ref)
        one = int(q[0]) if len(q) else 7
        assert uses.holds(one, qs).tolist() == [n > 0 for n in ref.get(np.full(len(qs), one), qs)]
        for key in all_keys[:6].tolist():
            r, s = rows.planned(key, floor, uses)
            assert (r.tolist(), s.tolist()) == _ref_planned(triples, ref, key, floor)


def test_rows_forget_reads_served_and_behind_the_floor() -> None:
    """`prune` keeps the arrays small: a read served to none and a step behind the floor are no longer held."""
    uses, rows = UnitUses(100), UnitRows()
    k = np.array([5, 5, 5, 9], dtype=np.int64)
    s = np.array([1, 2, 3, 3], dtype=np.int64)
    uses.add(k, s)
    rows.add(k, s, np.array([10, 11, 12, 0]))
    uses.consume(np.array([5]), np.array([2]))  # step 2's only read of unit 5: served
    rows.prune(2, uses)  # step 1 is behind the floor
    assert len(rows) == 2 and rows.planned(5, 0, uses)[0].tolist() == [12]
    assert uses.take_spent() is None  # told once


def test_a_read_served_to_none_then_planned_again_keeps_its_rows() -> None:
    """A pair served to none, then planned again (a chunk planned out of order) before the next prune is held: `prune`
    keeps its rows (the one planned first too, as the reference does), and forgets those of a pair still spent."""
    uses, rows = UnitUses(100), UnitRows()
    k = np.array([5, 5, 9], dtype=np.int64)
    s = np.array([4, 6, 4], dtype=np.int64)
    uses.add(k, s)
    rows.add(k, s, np.array([1, 2, 3]))
    uses.consume(np.array([5, 9, 5]), np.array([4, 4, 6]))  # all three served to none
    uses.add(np.array([5]), np.array([4]))  # (5, 4) planned again
    rows.add(np.array([5]), np.array([4]), np.array([7]))
    rows.prune(0, uses)
    assert rows.planned(5, 0, uses)[0].tolist() == [1, 7]  # (5, 6) and (9, 4) are forgotten
    assert len(rows) == 2 and len(uses) == 1
    assert uses.next_use(np.array([5, 9]), 0).tolist() == [4, -1]


@pytest.mark.parametrize("seed", range(4))
def test_rows_held_and_their_tail_answer_as_the_reference_across_merges(seed: int) -> None:
    """Session 28: chunks go into a tail merged into the held triples now and then; a key's rows are read from both,
    the held ones first (planned earlier), and prune forgets from both: every answer as the reference's, with the
    tail both empty and not at the moments asked (many small chunks in order, a few out of order)."""
    rng = np.random.default_rng(100 + seed)
    span, chunk = 3000, 8
    all_keys = unit_key(rng.integers(0, 3, 10), rng.integers(0, 50, 10))
    uses, rows, ref, triples = UnitUses(span), UnitRows(), _RefUses(span), []
    tails, merged, floor = 0, 0, 0
    for c in range(span // chunk):
        lo = c * chunk if rng.random() < 0.9 else int(rng.integers(0, (c + 1) * chunk))
        n = int(rng.integers(1, 30))
        k = rng.choice(all_keys, n)
        s = rng.integers(lo, lo + chunk, n)
        r = rng.integers(0, 2**32, n)  # any row a file may hold: packed beside its step
        before = len(rows._tail[0])
        uses.add(k, s)
        rows.add(k, s, r)
        ref.add(k, s)
        triples += list(zip(k.tolist(), s.tolist(), r.tolist(), strict=True))
        merged += len(rows._tail[0]) < before + n
        tails += len(rows._tail[0]) > 0
        if c % 5 == 4:  # serve the oldest planned step's reads, and prune now and then
            first = min(s_ for (_, s_), m in ref.left.items() if m > 0)
            pick = [p for p, m in ref.left.items() for _ in range(m) if p[1] == first]
            kk, ss = (np.array(x, dtype=np.int64) for x in zip(*pick, strict=True))
            uses.consume(kk, ss)
            ref.consume(kk, ss)
            if c % 10 == 9:
                floor = max(floor, first - 20)
                rows.prune(floor, uses)
                uses.prune(floor)
                ref.prune(floor)
                triples = [t for t in triples if t[1] >= floor and ref.left.get((t[0], t[1]), 0) > 0]
        for key in all_keys.tolist():
            got_r, got_s = rows.planned(key, floor, uses)
            assert (got_r.tolist(), got_s.tolist()) == _ref_planned(triples, ref, key, floor)
    assert tails > 10 and merged > 3  # both runs were read from, and the tail merged more than once


def test_reads_outside_what_is_packed_are_refused_or_ignored() -> None:
    """A planned row or step that does not fit its packing is a clear error naming it; a read served at a step no
    plan can hold (negative, or past 2**31) is ignored as any unplanned read is, a few at a time or a build group."""
    uses, rows = UnitUses(100), UnitRows()
    with pytest.raises(ValueError, match=r"row 4294967296 or step 3"):
        rows.add(np.array([5, 5]), np.array([2, 3]), np.array([1, 2**32]))
    with pytest.raises(ValueError, match=r"step -1"):
        rows.add(np.array([5]), np.array([-1]), np.array([1]))
    with pytest.raises(
        ValueError,
        match=r"planned steps must be in 0\.\.2\*\*31, got 0\.\.2147483648 \(read 1: unit key 5, step 2147483648\)",
    ):
        uses.add(np.array([5, 5]), np.array([0, 2**31]))
    assert len(rows) == 0 and len(uses) == 0
    uses.add(np.array([5, 5, 9]), np.array([1, 2, 2]))
    uses.consume(np.array([5, 5, 9]), np.array([2**40, -3, 2**31]))
    many = np.full(FEW_READS + 1, 5)
    uses.consume(many, np.full(FEW_READS + 1, 2**40))
    uses.consume(np.append(many, 5), np.append(np.arange(-FEW_READS - 1, 0), 2**33))
    assert uses.left(np.array([5, 5, 9]), np.array([1, 2, 2])).tolist() == [1, 1, 1]
    uses.consume(np.array([5]), np.array([1]))
    assert uses.next_use(np.array([5, 9]), 0).tolist() == [2, 2]


def test_a_chunk_refused_for_its_rows_leaves_the_cache_as_it_was() -> None:
    """`PlanUnitCache.plan` with a row that does not fit `UnitRows`' packing: the error names it, and nothing of the
    chunk is counted (its uses held without its rows would keep units wanted that no plan reads)."""
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=4, chunk_steps=2)
    cache = PlanUnitCache("plan-refused", steps=64, policy=policy, shard_of={}, clock=lambda: 0.0)
    keys = unit_key(np.array([0, 0]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"unit key \d+\) has row 4294967296"):
        cache.plan(keys, np.array([2, 3]), np.array([1, 2**32]))
    assert len(cache.uses) == 0 and len(cache.rows) == 0
    cache.plan(keys, np.array([2, 3]), np.array([1, 2]))
    assert len(cache.uses) == 2 and cache.rows.planned(int(keys[0]), 0, cache.uses)[0].tolist() == [1, 2]
    cache.close()

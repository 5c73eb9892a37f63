"""The plan's two baselines (planning._baselines) and the report's gain and pipeline figures (_report)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._baseline_kernel import concat_pieces, packed_pieces
from loomdata.planning._baselines import _SALT, _perm, baselines_flat, baselines_many, concat_chunk, perms
from loomdata.planning._cost import segment_cost
from loomdata.planning._report import ReportBuilder, StepFigures
from loomdata.schemas.spec import CostSpec

COST = CostSpec(attention=1.0, linear=10.0)
L = 100


def _c(*lengths: int) -> float:
    return float(segment_cost(np.array(lengths), None, COST, 1).sum())


def test_concat_chunk_cuts_documents_at_row_boundaries() -> None:
    # two documents of 75 tokens: rows [75 | 25] and [50]; one rank, two rows: its time is the pieces' cost
    got = concat_chunk(
        np.array([75, 75]), np.zeros(2, np.int64), t=3, seed=1, seq_len=L, dp=1, micro_batches=2, cost_spec=COST, cp=1
    )
    assert np.allclose(got, [_c(75, 25, 50)])


def test_concat_chunk_deals_row_j_to_rank_j_mod_dp_and_scales_partial_steps() -> None:
    # 3 full rows over dp 2, micro_batches 2: rank 0 gets rows 0 and 2, rank 1 row 1 (scaled to 2 rows), x 3/4
    got = concat_chunk(
        np.array([L, L, L]), np.zeros(3, np.int64), t=0, seed=0, seq_len=L, dp=2, micro_batches=2, cost_spec=COST, cp=1
    )
    assert np.allclose(got, [2 * _c(L) * 0.75, 2 * _c(L) * 0.75])


def _many(steps: list[list[int]], dp: int, mb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return baselines_many(
        range(len(steps)),
        [(np.array(x), np.zeros(len(x), np.int64)) for x in steps],
        seed=2,
        seq_len=L,
        dp=dp,
        micro_batches=mb,
        cost_spec=COST,
        cp=1,
    )


def test_packed_baseline_counts_what_does_not_fit_as_waiting_and_in_its_time() -> None:
    _, packed, waiting = _many([[60, 60], [30, 20]], 1, 1)
    assert list(waiting) == [60, 0]
    assert np.allclose(packed[0], [_c(60) * 2.0])  # half the step's tokens packed: twice the time for them
    assert np.allclose(packed[1], [_c(30, 20)])


def test_packed_baseline_cuts_long_documents_into_sequences() -> None:
    _, packed, waiting = _many([[250]], 3, 1)
    assert waiting[0] == 0
    assert np.allclose(np.sort(packed[0]), np.sort([_c(L), _c(L), _c(50)]))


def test_a_block_of_steps_gives_each_step_its_own_concat_chunk() -> None:
    rng = np.random.default_rng(0)
    steps = [list(rng.integers(1, 3 * L, int(rng.integers(1, 30)))) for _ in range(6)]
    concat, _, _ = _many(steps, 3, 2)
    for t, x in enumerate(steps):
        one = concat_chunk(
            np.array(x), np.zeros(len(x), np.int64), t=t, seed=2, seq_len=L, dp=3, micro_batches=2, cost_spec=COST, cp=1
        )
        assert np.allclose(one, concat[t])


def _fig(loom: list[float], concat: list[float], packed: list[float], slots: list[list[float]]) -> StepFigures:
    return StepFigures(
        tokens=np.array([10]),
        lb=float(np.mean(loom)),
        loom_rank=np.array(loom),
        concat_rank=np.array(concat),
        packed_rank=np.array(packed),
        slot_cost=np.array(slots),
        packed_waiting_tokens=0,
        deferred_tokens=0,
        rank_max_item=np.array([1.0, 1.0]),
    )


def test_report_gain_is_against_the_stronger_baseline_and_states_the_1f1b_bubble() -> None:
    r = ReportBuilder(2, ["a"], 2, pp_size=3)
    r.add(0, _fig([4.0, 4.0], [6.0, 2.0], [5.0, 3.0], [[3.0, 1.0], [2.0, 2.0]]))
    r.add(1, _fig([4.0, 4.0], [4.0, 4.0], [8.0, 0.0], [[2.0, 2.0], [2.0, 2.0]]))
    s = r.summary()
    assert np.isclose(s["gain"]["concat_chunk"], 10 / 8) and np.isclose(s["gain"]["packed"], 13 / 8)
    assert s["gain"]["stronger_baseline"] == "concat_chunk"
    assert np.isclose(s["simulated_gain"], 10 / 8)
    assert np.isclose(s["gain"]["per_step_vs_stronger"]["max"], 5 / 4)  # step 0: packed is the stronger one
    # step 0: rank 0 runs 4 + (3 - 1) x 3 = 10, rank 1 4 + 2 x 2 = 8; even micro-batches: 4 x (1 + 2 / 2) = 8
    assert np.isclose(r.cols["pp_time"][0], 10.0) and np.isclose(r.cols["pp_time_even"][0], 8.0)
    assert np.isclose(s["pipeline"]["uneven_micro_batch_cost"], 18 / 16 - 1)
    assert np.isclose(s["pipeline"]["bubble_share"], 1 - 8 / 18)


def test_block_permutations_are_numpys_seeded_permutations() -> None:
    """perms hashes every step's seed sequence at once and shuffles with the compiled PCG64: the same bits as
    default_rng([seed, salt, t]).permutation(n) step by step, for seeds of one and two words, t = 0 and 2^32 - 1,
    steps of 0, 1 and many segments (and numpy's own seeding past 32-bit steps)."""
    rng = np.random.default_rng(3)
    for seed in (0, 7, 2**32 - 1, 2**32, 2**64 - 1, -3):
        ts = np.concatenate([[0, 1, 2**32 - 1], rng.integers(0, 2**32, 20)])
        ns = np.concatenate([[0, 1, 2], rng.integers(0, 500, 20)])
        want = np.concatenate([_perm(seed, _SALT, int(t), int(n)) for t, n in zip(ts, ns, strict=True)])
        got = perms(seed, _SALT, ts, ns)
        assert got.dtype == want.dtype and np.array_equal(got, want)
    big = np.array([2**32, 5], dtype=np.int64)
    assert np.array_equal(
        perms(1, _SALT, big, np.array([4, 3])), np.concatenate([_perm(1, _SALT, 2**32, 4), _perm(1, _SALT, 5, 3)])
    )


def _concat_reference(ln: np.ndarray, im: np.ndarray, first: np.ndarray, seq: int, dp: int) -> list[np.ndarray]:
    """concat_pieces written out: each document's rows found by division, piece by piece."""
    out: list[tuple[int, int, int]] = []
    rows = []
    for t in range(len(first) - 1):
        at = 0
        for d in range(int(first[t]), int(first[t + 1])):
            n, end = int(ln[d]), at + int(ln[d])
            for row in range(at // seq, (end - 1) // seq + 1 if n else at // seq):
                p = min(end, (row + 1) * seq) - max(at, row * seq)
                out.append((t * dp + row % dp, p, int(im[d]) * p // max(n, 1)))
            at = end
        rows.append(-(-at // seq))
    cols = np.array(out, dtype=np.int64).reshape(-1, 3).T
    return [*cols, np.array(rows, dtype=np.int64)]


def _packed_reference(ln: np.ndarray, im: np.ndarray, first: np.ndarray, seq: int, dp: int, sequences: int) -> list:
    """packed_pieces written out: every piece of every document, next-fit, kept while within `sequences`."""
    out: list[tuple[int, int, int]] = []
    done = []
    for t in range(len(first) - 1):
        s, fill, tok = 0, 0, 0
        for d in range(int(first[t]), int(first[t + 1])):
            n = int(ln[d])
            for at in range(0, n, seq):
                p = min(seq, n - at)
                s, fill = (s + 1, p) if fill + p > seq else (s, fill + p)
                if s < sequences:
                    out.append((t * dp + s % dp, p, int(im[d]) * p // n))
                    tok += p
        done.append(tok)
    cols = np.array(out, dtype=np.int64).reshape(-1, 3).T
    return [*cols, np.array(done, dtype=np.int64)]


def test_compiled_pieces_match_a_piece_by_piece_reference() -> None:
    """concat_pieces and packed_pieces (rows and ranks followed as the documents go, a step's packing ended at its
    first piece past its sequences) give the pieces, rows and packed tokens the division-per-piece definition
    gives: empty documents and steps, documents longer than several rows, image tokens, dp 1 / 3 / 8."""
    rng = np.random.default_rng(11)
    for dp, seq, mb in ((1, 16, 1), (3, 16, 2), (8, 64, 1), (3, 7, 4)):
        ns = np.concatenate([[0, 1], rng.integers(0, 40, 30)])
        first = np.zeros(len(ns) + 1, dtype=np.int64)
        np.cumsum(ns, out=first[1:])
        ln = rng.integers(0, 5 * seq, int(first[-1])).astype(np.int64)
        ln[rng.random(len(ln)) < 0.1] = 0
        im = np.where(rng.random(len(ln)) < 0.5, rng.integers(0, 2 * seq, len(ln)), 0).astype(np.int64)
        im = np.minimum(im, ln)
        want_c = _concat_reference(ln, im, first, seq, dp)
        for got, want in zip(concat_pieces(ln, im, first, seq, dp), want_c, strict=True):
            assert np.array_equal(got, want)
        got_p = packed_pieces(ln, im, first, seq, dp, dp * mb)
        for got, want in zip(got_p, _packed_reference(ln, im, first, seq, dp, dp * mb), strict=True):
            assert np.array_equal(got, want)
        assert (got_p[3] < np.bincount(np.repeat(np.arange(len(ns)), ns), weights=ln, minlength=len(ns))).any()


@pytest.mark.parametrize(
    "cost",
    [
        CostSpec(attention=1.0, linear=24576.0),
        CostSpec(attention=0.3, linear=7.0, encoder=0.1875, encoder_linear=1152.0, encoder_window=17),
        CostSpec(attention=1.0, linear=3.0, encoder=0.5),
        CostSpec(attention=0.37, linear=1234.567, encoder=0.1, encoder_linear=11.1, encoder_window=5),
        CostSpec(attention=0.37, linear=1234.567),
    ],
)
def test_one_pass_baselines_are_the_piece_arrays_bits(cost: CostSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """baselines_flat's compiled pass a step (shuffle, cut, price and add each piece as it goes; without encoder
    terms the text pass, prices from a table) gives the same bytes as the piece arrays priced by CostSpec and
    summed by np.bincount: text and image samples, split pieces, steps that overflow the packed sequences, empty
    steps and empty documents, cp 1 to 3, int64 and uint32 lengths and image tokens; coefficients whose products
    round (one ulp off in any term fails)."""
    from loomdata.planning import _baselines

    passes = 0
    kernel = "baselines_pass" if cost.has_encoder else "baselines_text"
    real = getattr(_baselines, kernel)

    def counted(*a: object) -> object:
        nonlocal passes
        passes += 1
        return real(*a)

    monkeypatch.setattr(_baselines, kernel, counted)
    rng = np.random.default_rng(7)
    for trial in range(40):
        b = int(rng.integers(1, 30))
        ns = rng.integers(0, 50, b)
        ns[0] = 0 if trial % 5 == 0 else ns[0]
        n, seq = int(ns.sum()), int(rng.choice([50, 100, 4096]))
        length = rng.integers(0, 3 * seq, n).astype(np.uint32 if trial % 2 else np.int64)
        image = (rng.integers(0, seq, n) * (rng.random(n) < 0.3)).astype(np.uint32 if trial % 3 else np.int64)
        kw = {
            "seed": int(rng.integers(0, 2**63)),
            "seq_len": seq,
            "dp": int(rng.choice([1, 3, 8])),
            "micro_batches": int(rng.integers(1, 4)),
            "cost_spec": cost,
            "cp": int(rng.choice([1, 2, 3])),
        }
        ts = np.arange(b) + int(rng.integers(0, 2**32 - b))
        got = baselines_flat(ts, length, image, ns, **kw)  # type: ignore[arg-type]
        want = baselines_flat(ts, length, image, ns, one_pass=False, **kw)  # type: ignore[arg-type]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()
    assert passes == 40  # every trial took the compiled pass (the other call the piece arrays)


def _text_block(rng: np.random.Generator, dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """A random block for the text pass: step sizes with empty and one-document steps, lengths from a few values
    (ties) or a wide range (documents over several rows, empty ones), images present (unpriced without an
    encoder)."""
    b = int(rng.integers(1, 25))
    ns = rng.integers(0, 3 * dp + 40, b)
    ns[rng.random(b) < 0.15] = 0
    ns[rng.random(b) < 0.1] = 1
    n = int(ns.sum())
    seq = int(rng.choice([1, 7, 16, 100, 4096]))
    ties = rng.random() < 0.3
    length = rng.choice([0, seq // 2 + 1, seq, 3], n) if ties else rng.integers(0, 4 * seq + 2, n)
    length[rng.random(n) < 0.05] = 0
    image = rng.integers(0, seq + 1, n) * (rng.random(n) < 0.3)
    first = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ns, out=first[1:])
    return first, length.astype(np.uint32 if rng.random() < 0.5 else np.int64), image.astype(np.int64), ns, seq


@pytest.mark.parametrize("dp", [1, 2, 3, 8, 64, 1024])
def test_text_pass_is_the_general_pass_bits(dp: int) -> None:
    """baselines_text (values shuffled with draws made ahead, one walk, per-rank sums held while a row lasts,
    prices from price_table) gives the bytes baselines_pass gives where the cost has no encoder terms: random
    blocks with empty steps and documents, ties, documents over many rows, packed sequences from none to more
    than the step fills, cp 1 to 3, steps from 0 to 2^32 - 1 and seeds of one and two words."""
    from loomdata.planning._baseline_kernel import baselines_pass, baselines_text, price_table
    from loomdata.planning._baselines import _seed_states, _uint32_words

    rng = np.random.default_rng(dp)
    for _ in range(30):
        first, length, image, ns, seq = _text_block(rng, dp)
        a, lin = float(rng.choice([1.0, 0.37, 3.0])), float(rng.choice([0.0, 24576.0, 1234.567]))
        terms = np.array([a, lin, 0.0, 0.0, 0.0])
        cp = float(rng.integers(1, 4))
        seed = int(rng.choice([0, 2**32 + 5, int(rng.integers(0, 2**63))]))
        ts = rng.integers(0, 2**32, len(ns)).astype(np.uint32)
        ts[0] = 2**32 - 1
        states = _seed_states([*_uint32_words(seed), _SALT], ts)
        sequences = int(rng.choice([0, 1, dp, dp * int(rng.integers(1, 5)), 10**6]))
        want = baselines_pass(states, first, length, image, seq, dp, sequences, terms, -1, cp)
        got = baselines_text(states, first, length, seq, dp, sequences, price_table(seq, terms, -1, cp))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def test_values_shuffle_is_numpys_shuffle() -> None:
    """_shuffle_values (draws made ahead, two chains of states, branch-free acceptance, a mask a power of two)
    leaves values where default_rng([seed, salt, t]).permutation(m) takes them from, and where _shuffle_one leaves
    an index array: sizes 0 to 3, around powers of two and up to 5,000, ties, draw buffers from the least (16:
    every draw refilled) to the size baselines_text gives."""
    from loomdata.planning._baseline_kernel import _shuffle_one, _shuffle_values
    from loomdata.planning._baselines import _seed_states, _uint32_words

    rng = np.random.default_rng(5)
    sizes = [0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 4096, 5000]
    for seed in (0, 9, 2**40 + 3):
        ts = rng.integers(0, 2**32, len(sizes)).astype(np.uint32)
        states = _seed_states([*_uint32_words(seed), _SALT], ts)
        for i, m in enumerate(sizes):
            want = _perm(seed, _SALT, int(ts[i]), m)
            idx = np.arange(m, dtype=np.int64)
            _shuffle_one(states, i, idx, 0, m)
            assert np.array_equal(idx, want)
            vals = rng.integers(0, 4, m).astype(np.int64) * 1000 + (np.arange(m) if m % 2 else 0)
            for size in (16, 17, 2 * m + 16):
                got = vals.copy()
                _shuffle_values(states, i, got, m, np.empty(size, dtype=np.uint32))
                assert np.array_equal(got, vals[want])

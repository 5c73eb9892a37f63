"""The CP layout (chunks i and 2cp-1-i of 2cp) and the per-CP-rank attention cost of packed sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomdata.schemas import CostSpec, cp_chunk_bounds, cp_imbalance, cp_positions, cp_rank_costs


def test_layout_pairs_chunk_i_with_chunk_2cp_minus_1_minus_i() -> None:
    assert cp_chunk_bounds(16, 2).tolist() == [0, 4, 8, 12, 16]
    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    for cp in (1, 2, 3, 4, 8):
        seq_len = 1000  # not a multiple of 2cp for cp 3: chunks differ by at most one position
        held = np.concatenate([cp_positions(seq_len, cp, i) for i in range(cp)])
        assert np.array_equal(np.sort(held), np.arange(seq_len))
        sizes = np.diff(cp_chunk_bounds(seq_len, cp))
        assert sizes.max() - sizes.min() <= 1


def test_layout_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"cp_rank must be in 0\.\.1"):
        cp_positions(16, 2, 2)
    with pytest.raises(ValueError, match="too short for 8"):
        cp_chunk_bounds(6, 4)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        cp_chunk_bounds(6, 0)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_one_full_length_document_costs_exactly_the_same_on_every_cp_rank(cp: int) -> None:
    seq_len = 32768
    cost = CostSpec(attention=1.0, linear=24576.0)
    c = cp_rank_costs([seq_len], [0], seq_len, cp, cost)
    assert c.shape == (1, cp)
    assert np.all(c == c[0, 0])  # exactly equal, not approximately
    assert c.sum() == cost.of([seq_len]).sum()  # the ranks' shares add up to the whole cost
    assert cp_imbalance(c).tolist() == [1.0]


def test_a_naive_contiguous_split_would_not_be_balanced() -> None:
    """The reason for the layout: under causal attention, rank i of a contiguous split pays (2i+1)x."""
    seq_len, cp = 4096, 4
    cost = CostSpec(attention=1.0, linear=0.0)
    pairs = cp_rank_costs([seq_len], [0], seq_len, cp, cost)[0]
    q = seq_len // cp  # contiguous quarter i: sum over p in [iq, (i+1)q) of (2p+1)
    contiguous = np.array([((i + 1) * q) ** 2 - (i * q) ** 2 for i in range(cp)], dtype=np.float64)
    assert contiguous.max() / contiguous.mean() == pytest.approx(1.75)
    assert pairs.max() / pairs.mean() == 1.0


def test_packed_documents_are_priced_per_rank_by_hand() -> None:
    # seq_len 8, cp 2: chunks [0,2) [2,4) [4,6) [6,8); rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    # documents: A = [0,6) (6 tokens), B = [6,8) (2 tokens); attention-only cost of in-doc position p is 2p+1.
    cost = CostSpec(attention=1.0, linear=0.0)
    c = cp_rank_costs([6, 2], [0, 0], 8, 2, cost)
    rank0 = (1 + 3) + (1 + 3)  # A positions 0, 1; B positions 0, 1
    rank1 = (5 + 7) + (9 + 11)  # A positions 2..5
    assert c.tolist() == [[rank0, rank1]]
    assert cp_imbalance(c)[0] == pytest.approx(rank1 / ((rank0 + rank1) / 2))
    lin = cp_rank_costs([6, 2], [0, 0], 8, 2, CostSpec(attention=0.0, linear=1.0))
    assert lin.tolist() == [[4.0, 4.0]]  # the linear term counts real tokens held


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 200), min_size=0, max_size=6), min_size=1, max_size=5),
    st.sampled_from([1, 2, 3, 4]),
)
def test_rank_costs_match_a_token_by_token_count_and_sum_to_the_cost_model(docs: list[list[int]], cp: int) -> None:
    seq_len = 1200
    cost = CostSpec(attention=1.0, linear=7.0)
    lengths = np.array([n for d in docs for n in d], dtype=np.int64)
    seq = np.array([k for k, d in enumerate(docs) for _ in d], dtype=np.int64)
    got = cp_rank_costs(lengths, seq, seq_len, cp, cost, num_sequences=len(docs))
    for k, d in enumerate(docs):  # the slow, obvious count: every real token's (2p + 1) + linear, by its rank
        per_pos = np.zeros(seq_len)
        at = 0
        for n in d:
            p = np.arange(n)
            per_pos[at : at + n] = cost.attention * (2 * p + 1) + cost.linear
            at += n
        want = [per_pos[cp_positions(seq_len, cp, i)].sum() for i in range(cp)]
        np.testing.assert_allclose(got[k], want, rtol=1e-12)
        assert got[k].sum() == pytest.approx(cost.of(d).sum(), rel=1e-12)


def test_rank_costs_refuse_inconsistent_input() -> None:
    cost = CostSpec()
    with pytest.raises(ValueError, match="grouped by sequence"):
        cp_rank_costs([1, 1], [1, 0], 8, 2, cost)
    with pytest.raises(ValueError, match="more than seq_len 8"):
        cp_rank_costs([5, 4], [0, 0], 8, 2, cost)
    assert cp_rank_costs([], [], 8, 2, cost, num_sequences=2).tolist() == [[0.0, 0.0], [0.0, 0.0]]

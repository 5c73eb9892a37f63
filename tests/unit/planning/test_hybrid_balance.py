"""`cost.balance: both`: the hybrid encoder/backbone search, on seeded random multimodal plans and by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.planning import make_plan, plan_report
from loomdata.planning._baselines import baselines_many
from loomdata.planning.balance._hybrid import _units, hybrid_objective, hybrid_search
from loomdata.planning.balance._state import Dealt, Slots
from loomdata.schemas.plan import read_manifest, read_plan
from loomdata.schemas.spec import CostSpec, Spec
from loomtest.golden_plans import plan_hashes

from .conftest import index_table, make_spec

# a small ViT beside the backbone: 64 patches per image, so that 512-token sequences hold a few images
TERMS = {"encoder": 0.1875, "encoder_linear": 1152.0, "encoder_window": 64}
SEQ_LEN = 512


def _index(seed: int) -> dict[str, pa.Table]:
    """captions (one or two images of up to 64 patches plus a caption) and text, as an index holds them."""
    rng = np.random.default_rng(seed)
    n = 3000
    img = rng.integers(16, 65, n) * np.where(rng.random(n) < 0.2, 2, 1)
    caps = img + rng.integers(3, 40, n)
    text = np.clip(rng.lognormal(4.5, 1.0, 4 * n), 8, 2000).astype(np.int64)
    return {"caps": index_table(caps, img), "text": index_table(text)}


def _spec(tmp: Path, balance: str, dp: int, mb: int, seed: int, steps: int = 12) -> Spec:
    base = make_spec(
        tmp,
        ["caps", "text"],
        weights={"caps": 0.5, "text": 0.5},
        seq_len=SEQ_LEN,
        steps=steps,
        dp=dp,
        micro_batches=mb,
        seed=seed,
    )
    return base.model_copy(update={"cost": CostSpec(**TERMS, balance=balance)})  # type: ignore[arg-type]


def _steps(plan_dir: Path) -> dict[str, np.ndarray]:
    t = pq.read_table(plan_dir / "report" / "steps.parquet")
    return {k: t.column(k).to_numpy() for k in t.column_names}


def _objective(rows: dict[str, np.ndarray], who: str = "loom") -> np.ndarray:
    return np.maximum(rows[f"{who}_enc_max"] / rows["enc_lb"], rows[f"{who}_bb_max"] / rows["bb_lb"])


def _rows(plan_dir: Path) -> pa.Table:
    meta = read_plan(plan_dir)
    return read_manifest(plan_dir, meta, 0, meta.steps - 1)


CASES = [(2, 2, 1), (4, 1, 2), (4, 4, 3), (8, 2, 4), (8, 4, 5), (16, 2, 6), (64, 2, 7)]


@pytest.mark.parametrize(("dp", "mb", "seed"), CASES)
def test_both_is_never_worse_than_sum_on_the_hybrid_objective(tmp_path: Path, dp: int, mb: int, seed: int) -> None:
    index = _index(seed)
    plans = {b: make_plan(_spec(tmp_path / b, b, dp, mb, seed), index=index).plan_dir for b in ("sum", "both")}
    s, b = _steps(plans["sum"]), _steps(plans["both"])
    assert np.array_equal(s["tokens"], b["tokens"]) and np.array_equal(s["enc_lb"], b["enc_lb"])
    assert (_objective(b) <= _objective(s) * (1 + 1e-9)).all()  # step by step
    assert _objective(b).mean() < _objective(s).mean()  # and it does balance the encoder
    # the same segments in every step (membership, splits and deferrals are sum's): each placed once, as in sum
    rs, rb = _rows(plans["sum"]), _rows(plans["both"])
    cols = ["step", "source", "sample", "offset", "length"]
    key_s = np.stack([rs.column(c).to_numpy().astype(np.int64) for c in cols])
    key_b = np.stack([rb.column(c).to_numpy().astype(np.int64) for c in cols])
    assert np.array_equal(key_s[:, np.lexsort(key_s[::-1])], key_b[:, np.lexsort(key_b[::-1])])
    # every slot holds at most seq_len tokens
    slot = (rb["step"].to_numpy().astype(np.int64) * dp + rb["dp_rank"].to_numpy()) * mb + rb["micro_batch"].to_numpy()
    assert np.bincount(slot, weights=rb["length"].to_numpy()).max() <= SEQ_LEN
    # rows stay in manifest order
    assert (np.diff(slot) >= 0).all()


def test_both_is_deterministic_and_sum_given_explicitly_is_the_default_plan(tmp_path: Path) -> None:
    index = _index(9)
    a = make_plan(_spec(tmp_path / "a", "both", 8, 2, 9), index=index)
    b = make_plan(_spec(tmp_path / "b", "both", 8, 2, 9), index=index)
    assert read_plan(a.plan_dir).plan_id == read_plan(b.plan_dir).plan_id
    assert plan_hashes(a.plan_dir) == plan_hashes(b.plan_dir)
    plain = make_spec(
        tmp_path / "c", ["caps", "text"], weights={"caps": 0.5, "text": 0.5}, seq_len=SEQ_LEN, steps=12, dp=8
    )
    explicit = plain.model_copy(update={"cost": CostSpec(balance="sum")})
    c, d = (
        make_plan(plain, index=index),
        make_plan(explicit.model_copy(update={"workdir": tmp_path / "d"}), index=index),
    )
    assert read_plan(c.plan_dir).plan_id == read_plan(d.plan_dir).plan_id
    assert plan_hashes(c.plan_dir) == plan_hashes(d.plan_dir)
    assert "hybrid" not in plan_report(c.plan_dir)  # no encoder term: no encoder/backbone figures


def test_report_gives_encoder_and_backbone_apart_for_loomdata_and_both_baselines(tmp_path: Path) -> None:
    res = make_plan(_spec(tmp_path, "both", 8, 2, 3), index=_index(3))
    h = plan_report(res.plan_dir)["hybrid"]
    assert h["balance"] == "both"
    for part in ("encoder", "backbone"):  # LB = max(mean, largest segment) lies between loomdata's mean and max
        over_lb, over_mean = h["loomdata"][part]["max_over_lb"]["mean"], h["loomdata"][part]["max_over_mean"]["mean"]
        assert 1.0 - 1e-9 <= over_lb <= over_mean + 1e-9
        for who in ("concat_chunk", "packed"):  # the baselines cut documents (their pieces cost less): > 0 only
            assert h[who][part]["max_over_lb"]["mean"] > 0 and h[who][part]["max_over_mean"]["mean"] >= 1.0
    for who in ("loomdata", "concat_chunk", "packed"):
        assert h[who]["objective"]["mean"] > 0 and h[who]["step_time"] > 0
    assert h["loomdata"]["objective"]["mean"] < min(h[w]["objective"]["mean"] for w in ("concat_chunk", "packed"))
    assert h["gain"]["concat_chunk"] > 1.0 and h["gain"]["packed"] > 1.0
    rows = _steps(res.plan_dir)
    assert np.allclose(rows["loom_enc_mean"] + rows["loom_bb_mean"], rows["loom_mean"])


def test_baseline_parts_add_up_to_the_baselines_summed_cost() -> None:
    rng = np.random.default_rng(0)
    steps = [(rng.integers(10, 300, 40), np.where(rng.random(40) < 0.5, rng.integers(1, 9, 40), 0)) for _ in range(3)]
    steps = [(ln, np.minimum(im, ln)) for ln, im in steps]
    kw = {"seed": 1, "seq_len": 256, "dp": 4, "micro_batches": 2, "cost_spec": CostSpec(**TERMS), "cp": 1}  # type: ignore[arg-type]
    total = baselines_many(range(3), steps, **kw)  # type: ignore[arg-type]
    enc = baselines_many(range(3), steps, part="encoder", **kw)  # type: ignore[arg-type]
    bb = baselines_many(range(3), steps, part="backbone", **kw)  # type: ignore[arg-type]
    for k in (0, 1):
        assert np.allclose(enc[k] + bb[k], total[k]) and enc[k].sum() > 0
    assert np.array_equal(enc[2], total[2])  # the same layouts: the same tokens wait


def _dealt(ranks: list[list[tuple[int, float, float]]], seq_len: int) -> tuple[Dealt, np.ndarray, np.ndarray]:
    """One step, one micro-batch per rank; rank r holds items (length, encoder cost, backbone cost)."""
    dp = len(ranks)
    items = [x for r in ranks for x in r]
    length = np.array([x[0] for x in items], dtype=np.int64)
    enc = np.array([x[1] for x in items])
    cost = enc + np.array([x[2] for x in items])
    rank = np.array([k for k, r in enumerate(ranks) for _ in r], dtype=np.int64)
    rc = np.bincount(rank, weights=cost, minlength=dp)
    room = seq_len - np.bincount(rank, weights=length, minlength=dp).astype(np.int64)
    st = Slots(rc.reshape(dp, 1).copy(), room.reshape(dp, 1), np.zeros((dp, 1), dtype=np.uint8), rc.copy())
    n = len(items)
    d = Dealt(st, rank.copy(), np.zeros(n, dtype=np.int64), np.arange(n), np.zeros(0, dtype=np.int64), length)
    return d, cost, enc


def _check(d: Dealt, cost: np.ndarray, enc: np.ndarray, seq_len: int) -> float:
    dp = d.st.cost.shape[0]
    rc = np.bincount(d.p_rank, weights=cost, minlength=dp)
    tokens = np.bincount(d.p_rank, weights=d.length, minlength=dp)
    assert np.allclose(rc, d.st.rank_cost) and np.allclose(rc, d.st.cost[:, 0])
    assert np.array_equal(seq_len - tokens, d.st.room[:, 0]) and (tokens <= seq_len).all()
    e = np.bincount(d.p_rank, weights=enc, minlength=dp)
    lb_e, lb_b = max(enc.sum() / dp, enc.max()), max((cost - enc).sum() / dp, (cost - enc).max())
    return float(hybrid_objective(e[None], (rc - e)[None], np.array([lb_e]), np.array([lb_b]))[0])


def test_a_swap_spreads_the_images_when_the_summed_costs_are_already_even() -> None:
    # both ranks cost 220 in sum; rank 0 holds both images: encoder max / LB = 2, a swap makes it 1
    d, cost, enc = _dealt([[(100, 10.0, 100.0), (100, 10.0, 100.0)], [(100, 0.0, 110.0), (100, 0.0, 110.0)]], 200)
    assert _check(d, cost, enc, 200) == pytest.approx(2.0)
    hybrid_search([d], [cost], [enc], [np.zeros(4, dtype=np.uint8)])
    assert _check(d, cost, enc, 200) == pytest.approx(1.0)


def test_an_exchange_trades_one_image_for_several_texts_when_every_rank_is_full() -> None:
    # every rank is full, no single text is as long as an image sample: only one-for-two exchanges fit
    d, cost, enc = _dealt([[(100, 10.0, 100.0), (100, 10.0, 100.0)], [(50, 0.0, 50.0)] * 4], 200)
    assert _check(d, cost, enc, 200) == pytest.approx(2.0)
    hybrid_search([d], [cost], [enc], [np.zeros(6, dtype=np.uint8)])
    assert _check(d, cost, enc, 200) == pytest.approx(1.0)


@pytest.mark.parametrize("dp", [3, 8, 9, 10, 64, 512])
def test_the_units_of_a_round_share_no_rank(dp: int) -> None:
    rng = np.random.default_rng(dp)
    e_n, b_n = rng.uniform(0.5, 1.5, (3, dp)), rng.uniform(0.5, 1.5, (3, dp))
    u_row, h, part = _units(np.maximum(e_n, b_n), e_n, b_n, dp)
    for s in range(3):
        mine = u_row == s
        ranks = np.concatenate([h[mine], part[mine][part[mine] >= 0]])
        assert len(ranks) == len(np.unique(ranks)) and mine.any()
        assert mine.sum() == 1 or dp > 9  # several units only at large dp

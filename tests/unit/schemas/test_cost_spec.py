"""CostSpec: the encoder part beside the backbone part, `balance: sum | both`, and plan ids kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from loomdata.schemas.errors import SpecError
from loomdata.schemas.spec import CostBalance, CostSpec, parse_spec


def _raw(tmp_path: Path, cost: dict[str, object] | None = None) -> dict[str, object]:
    raw: dict[str, object] = {
        "name": "t",
        "workdir": str(tmp_path),
        "sources": [{"name": "a", "format": "parquet", "paths": ["x/*.parquet"], "tokens_field": "ids"}],
        "mixture": {"weights": {"a": 1.0}},
        "training": {"seq_len": 128, "steps": 2, "dp_size": 2},
    }
    if cost is not None:
        raw["cost"] = cost
    return raw


def test_default_cost_is_summed_and_its_formula_is_unchanged() -> None:
    c = CostSpec(encoder=0.5)
    assert c.balance is CostBalance.SUM
    n, img = np.array([1000, 300, 7]), np.array([600, 0, 7])
    expected = (1.0 * n * n.astype(np.float64) + 24576.0 * n + 0.5 * img * img.astype(np.float64)) / 2
    assert np.array_equal(c.of(n, img, 2), expected)  # byte for byte what the formula gave before parts
    bb, enc = c.parts(n, img, 2)
    assert np.allclose(bb + enc, c.of(n, img, 2), rtol=1e-15)
    assert enc[1] == 0 and np.array_equal(bb, (n * n.astype(np.float64) + 24576.0 * n) / 2)


def test_encoder_window_prices_each_image_on_its_own() -> None:
    c = CostSpec(encoder=0.25, encoder_linear=100.0, encoder_window=1024)
    _, enc = c.parts([2100, 1100, 600], [2048, 1024, 500])
    per_image = 0.25 * 1024**2 + 100.0 * 1024
    assert enc[0] == pytest.approx(2 * per_image) and enc[1] == pytest.approx(per_image)
    assert enc[2] == pytest.approx(0.25 * 500**2 + 100.0 * 500)  # a small image attends to itself only
    assert np.array_equal(CostSpec().parts([5], [5])[1], [0.0])  # no encoder term: no encoder part


def test_new_keys_at_their_defaults_leave_dumps_and_plan_ids_as_before(tmp_path: Path) -> None:
    plain = parse_spec(_raw(tmp_path), tmp_path, check_paths=False)
    explicit = parse_spec(
        _raw(tmp_path, {"balance": "sum", "encoder_linear": 0.0, "encoder_window": None}), tmp_path, check_paths=False
    )
    assert plain.content_json() == explicit.content_json()
    assert "balance" not in plain.content_json() and "encoder_window" not in plain.canonical_json()
    assert plain.model_dump()["cost"] == {"attention": 1.0, "linear": 24576.0, "encoder": 0.0}
    both = parse_spec(_raw(tmp_path, {"balance": "both"}), tmp_path, check_paths=False)
    assert both.content_json() != plain.content_json()
    assert parse_spec(both.model_dump(mode="json"), tmp_path, check_paths=False) == both  # round trip


def test_balance_both_fills_in_vit_l14_terms_when_none_is_given() -> None:
    c = CostSpec(balance="both")
    assert (c.encoder, c.encoder_linear, c.encoder_window) == (0.1875, 1152.0, 1024)
    given = CostSpec(balance="both", encoder=2.0)  # one given: the others keep their own defaults
    assert (given.encoder, given.encoder_linear, given.encoder_window) == (2.0, 0.0, None)


def test_bad_cost_keys_are_reported_with_their_key_path(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(
            _raw(tmp_path, {"balance": "max", "encoder_window": 0, "encoder_linear": -1}), tmp_path, check_paths=False
        )
    text = str(e.value)
    assert "cost.balance" in text and "cost.encoder_window" in text and "cost.encoder_linear" in text
    with pytest.raises(SpecError, match="encoder terms are 0"):
        parse_spec(_raw(tmp_path, {"balance": "both", "encoder": 0.0}), tmp_path, check_paths=False)
    with pytest.raises(ValidationError):
        CostSpec(balance="both", encoder=0.0, encoder_linear=0.0)


def test_cost_model_record_costs_as_the_spec() -> None:
    """The plain `CostModel` a constructor predicts with is the `CostSpec` formula (one implementation)."""
    import numpy as np

    from loomdata.schemas.records import CostModel
    from loomdata.schemas.spec import CostSpec

    lengths, images = np.array([0, 7, 300, 4096]), np.array([0, 3, 1024, 2048])
    for spec in (CostSpec(), CostSpec(balance="both"), CostSpec(encoder=0.5, attention=2.0)):
        model = CostModel.from_spec(spec)
        assert CostModel.from_json(spec.model_dump(mode="json")) == model
        for cp in (1, np.array([1, 2, 2, 4])):
            assert np.array_equal(model.of(lengths, images, cp), spec.of(lengths, images, cp))
            assert all(
                np.array_equal(a, b)
                for a, b in zip(model.parts(lengths, images, cp), spec.parts(lengths, images, cp), strict=True)
            )
    assert CostModel.from_spec(CostSpec(balance="both")).of([10], [10]) > CostModel().of([10], [10])

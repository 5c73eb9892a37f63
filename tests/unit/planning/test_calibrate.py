"""`loom calibrate` parts: the measurement file, the fit quality, the rewritten cost block, the balance change."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from loomdata.cli import main
from loomdata.planning import (
    Measurement,
    MeasurementError,
    balance_change,
    calibrate,
    read_measurements,
    with_cost_block,
    write_measurements,
)
from loomdata.schemas import CostSpec, LoomError, Spec, load_spec


def _exact_runs(n: int, attention: float, linear: float, per_unit: float, seed: int = 0) -> list[Measurement]:
    """Runs whose seconds are exactly per_unit * (attention L^2 + linear L) summed over their segments."""
    rng = np.random.default_rng(seed)
    runs = []
    for i in range(n):
        lengths = rng.integers(1, 4096, size=int(rng.integers(1, 9)))
        secs = per_unit * float((attention * lengths**2 + linear * lengths).sum())
        runs.append(Measurement(lengths=lengths, seconds=secs, notes={"rank": i % 4}))
    return runs


def test_an_exact_synthetic_fit_recovers_the_cost_with_r2_one(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert write_measurements(path, _exact_runs(40, attention=2.0, linear=3000.0, per_unit=1e-9)) == 40
    fit = calibrate(read_measurements(path))
    assert fit.cost.attention == pytest.approx(1.0)
    assert fit.cost.linear == pytest.approx(1500.0, rel=1e-6)
    assert fit.crossover_length == pytest.approx(1500.0, rel=1e-6)
    assert fit.seconds_per_unit == pytest.approx(2e-9, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.median_rel_error < 1e-9 and fit.p90_rel_error < 1e-9
    assert fit.runs == 40


def test_noisy_times_give_a_lower_r2_and_their_relative_errors() -> None:
    runs = _exact_runs(200, attention=1.0, linear=1000.0, per_unit=1e-9)
    rng = np.random.default_rng(1)
    noisy = [Measurement(m.lengths, m.seconds * float(rng.uniform(0.8, 1.2))) for m in runs]
    fit = calibrate(noisy)
    assert 0.5 < fit.r2 < 0.999
    assert 0.02 < fit.median_rel_error < 0.2
    assert fit.median_rel_error <= fit.p90_rel_error < 0.3


def test_image_tokens_fit_the_encoder_term(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    lines = []
    for _ in range(30):
        lengths = rng.integers(100, 2000, size=3)
        img = rng.integers(0, 1000, size=3)
        secs = 1e-9 * float((lengths**2 + 500 * lengths + 4 * img**2).sum())
        lines.append(json.dumps({"lengths": lengths.tolist(), "image_tokens": img.tolist(), "seconds": secs}))
    path = tmp_path / "img.jsonl"
    path.write_text("# a comment line\n\n" + "\n".join(lines) + "\n")
    fit = calibrate(read_measurements(path))
    assert fit.cost.encoder == pytest.approx(4.0, rel=1e-6)
    assert fit.cost.linear == pytest.approx(500.0, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)


def test_a_measurement_line_round_trips_with_its_annotations(tmp_path: Path) -> None:
    m = Measurement(np.array([5, 7]), 0.25, np.array([0, 3]), {"step": 2, "arm": "loomdata"})
    path = tmp_path / "one.jsonl"
    write_measurements(path, [m, m])
    back = read_measurements(path)
    assert [b.lengths.tolist() for b in back] == [[5, 7], [5, 7]]
    assert back[0].image_tokens is not None and back[0].image_tokens.tolist() == [0, 3]
    assert back[0].seconds == 0.25 and dict(back[0].notes) == {"step": 2, "arm": "loomdata"}


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"lengths": [1, 2], "seconds": 0.1', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"lengths": [1, 2]}', "missing key.*seconds"),
        ('{"lengths": [], "seconds": 0.1}', "`lengths` must be a non-empty list"),
        ('{"lengths": [1, 0], "seconds": 0.1}', "`lengths` must hold positive integers"),
        ('{"lengths": [1.5], "seconds": 0.1}', "`lengths` must hold integers only"),
        ('{"lengths": [3], "seconds": -1}', "`seconds` must be a positive number"),
        ('{"lengths": [3], "seconds": "fast"}', "`seconds` must be a positive number"),
        ('{"lengths": [3, 4], "image_tokens": [1], "seconds": 1}', "`image_tokens` has 1 entries"),
    ],
)
def test_a_bad_line_names_the_file_and_line_number(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"lengths": [10], "seconds": 0.1}\n\n' + line + '\n{"lengths": [20], "seconds": 0.2}\n')
    with pytest.raises(MeasurementError, match=rf"bad\.jsonl, line 3: {why}") as e:
        read_measurements(path)
    assert isinstance(e.value, LoomError) and '"lengths"' in str(e.value)


@pytest.mark.parametrize("body", ["", "# only a comment\n", '{"lengths": [10], "seconds": 0.1}\n'])
def test_fewer_than_two_runs_is_an_error(tmp_path: Path, body: str) -> None:
    path = tmp_path / "short.jsonl"
    path.write_text(body)
    with pytest.raises(MeasurementError, match=r"short\.jsonl: [01] measured run\(s\); the fit needs at least 2"):
        read_measurements(path)
    with pytest.raises(MeasurementError, match="at least 2"):
        calibrate([])


def test_a_missing_file_is_a_measurement_error(tmp_path: Path) -> None:
    with pytest.raises(MeasurementError, match=r"nope\.jsonl: cannot read measurements"):
        read_measurements(tmp_path / "nope.jsonl")


SPEC_TEXT = """\
# a spec with comments everywhere
name: t   # the name
workdir: work
sources:
  - name: web            # short documents
    format: parquet
    paths: ["x/*.parquet"]
    tokens_field: ids
mixture:
  weights: {web: 1.0}
cost:                    # about a 7B model
  attention: 1.0
  # the linear term
  linear: 24576

training:                # after the cost block
  seq_len: 128
  steps: 4
  dp_size: 2
"""


def test_with_cost_block_replaces_only_the_cost_block_and_keeps_comments(tmp_path: Path) -> None:
    cost = CostSpec(attention=1.0, linear=1523.25, encoder=0.0)
    text, kept = with_cost_block(SPEC_TEXT, cost, note="fitted")
    assert kept
    assert "# about a 7B model" not in text and "# the linear term" not in text
    for line in SPEC_TEXT.splitlines():
        if line.startswith(("cost:", "  attention", "  # the linear", "  linear")):
            continue
        assert line in text.splitlines(), line
    assert "cost:  # fitted\n  attention: 1.0\n  linear: 1523.25\n  encoder: 0.0\n\ntraining:" in text
    old, new = yaml.safe_load(SPEC_TEXT), yaml.safe_load(text)
    assert new.pop("cost") == {"attention": 1.0, "linear": 1523.25, "encoder": 0.0}
    old.pop("cost")
    assert new == old
    (tmp_path / "out.yaml").write_text(text)
    assert load_spec(tmp_path / "out.yaml", check_paths=False).cost == cost


def test_with_cost_block_appends_a_block_when_the_spec_has_none_and_writes_floats_yaml_reads() -> None:
    text = SPEC_TEXT.replace("cost:                    # about a 7B model\n  attention: 1.0\n", "").replace(
        "  # the linear term\n  linear: 24576\n", ""
    )
    assert "cost" not in yaml.safe_load(text)
    out, kept = with_cost_block(text, CostSpec(attention=1e-5, linear=3.0, encoder=2.5e-7))
    assert kept and out.startswith(text)
    assert yaml.safe_load(out)["cost"] == {"attention": 1e-5, "linear": 3.0, "encoder": 2.5e-7}


def test_with_cost_block_falls_back_to_a_full_dump_for_a_layout_it_cannot_edit() -> None:
    text = "name: t\ncost: &c {attention: 1.0, linear: 5.0}\nother: *c\n"  # an anchor the edit would break
    out, kept = with_cost_block(text, CostSpec(attention=1.0, linear=7.0))
    assert not kept and out.startswith("# written by `loom calibrate` (the original's comments were dropped)")
    data = yaml.safe_load(out)
    assert data["cost"]["linear"] == 7.0 and data["other"] == {"attention": 1.0, "linear": 5.0}


def test_balance_change_costs_both_plans_under_the_fitted_cost(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table]
) -> None:
    rng = np.random.default_rng(3)
    index = {
        "web": index_of(np.clip(rng.lognormal(4.0, 1.0, 4000), 4, 512).astype(int)),
        "books": index_of(rng.integers(200, 1200, 300)),
    }
    spec = spec_of(tmp_path, ["web", "books"], weights={"web": 0.7, "books": 0.3}, seq_len=512, steps=6, dp=4)
    fitted = CostSpec(attention=1.0, linear=20.0)  # attention-heavy, unlike the default
    change = balance_change(spec, fitted, index=index, fingerprints={"web": "w", "books": "b"})
    assert change.old_plan_dir != change.new_plan_dir
    assert not (tmp_path / "plans").exists()  # planned in a temporary folder
    # the re-plan is at least as balanced under the cost it was made for as the old plan is
    assert change.new_under_fit <= change.old_under_fit + 1e-9
    assert change.new_under_fit == pytest.approx(change.new_own, rel=1e-6)
    d = change.to_dict()
    assert d["predicted_gain_of_replan"] == pytest.approx(change.old_under_fit / change.new_under_fit)


def test_cli_calibrate_prints_json_and_writes_the_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC_TEXT)
    write_measurements(tmp_path / "m.jsonl", _exact_runs(20, attention=1.0, linear=800.0, per_unit=1e-8))
    out_spec = tmp_path / "fitted.yaml"
    args = ["calibrate", str(tmp_path / "spec.yaml"), str(tmp_path / "m.jsonl"), "--write-spec", str(out_spec)]
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["cost"]["linear"] == pytest.approx(800.0, rel=1e-6) and got["r2"] == pytest.approx(1.0)
    assert got["old_cost"]["linear"] == 24576 and got["balance"] is None
    assert got["written_spec"] == {"path": str(out_spec), "comments_kept": True}
    assert load_spec(out_spec, check_paths=False).cost.linear == pytest.approx(800.0, rel=1e-5)
    assert main(args) == 0
    human = capsys.readouterr().out
    assert "R2 1.0000" in human and "no index under" in human


def test_cli_calibrate_bad_file_exits_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC_TEXT)
    (tmp_path / "m.jsonl").write_text('{"lengths": [1], "seconds": 1}\n{"lengths": "x", "seconds": 1}\n')
    assert main(["calibrate", str(tmp_path / "spec.yaml"), str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "loom calibrate: error:" in err and "m.jsonl, line 2" in err and "Traceback" not in err

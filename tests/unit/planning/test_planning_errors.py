"""make_plan refuses impossible specs with a PlanError that names the source, step or sample and the fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from loomdata.planning import PlanResume, make_plan
from loomdata.schemas.errors import ContractError, PlanError, SpecError
from loomdata.schemas.plan import read_manifest


def test_unknown_source_in_the_mixture_is_refused_by_the_spec(tmp_path: Path, spec_of: Callable[..., Any]) -> None:
    # the mixture's rules live in parse_spec; planning trusts a validated Spec
    with pytest.raises(SpecError, match=r"mixture.weights.wiki: unknown source 'wiki' \(known: web\)"):
        spec_of(tmp_path, ["web"], weights={"web": 1.0, "wiki": 1.0})


def test_missing_index_table_for_a_source(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    spec = spec_of(tmp_path, ["web", "code"])
    with pytest.raises(PlanError, match="no index table given for source 'code'"):
        make_plan(spec, index={"web": index_of([10] * 50)})


def test_index_table_with_the_wrong_schema(tmp_path: Path, spec_of: Callable[..., Any]) -> None:
    spec = spec_of(tmp_path, ["web"])
    with pytest.raises(ContractError, match="missing column 'num_tokens'"):
        make_plan(spec, index={"web": pa.table({"sample": pa.array([0], pa.uint64())})})


@pytest.mark.parametrize("lengths", [[], [0, 0, 0]])
def test_empty_source_with_positive_weight(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any, lengths: list[int]
) -> None:
    spec = spec_of(
        tmp_path,
        ["web", "code"],
        schedule=[
            {"step": 0, "weights": {"web": 1.0, "code": 0.0}},
            {"step": 4, "weights": {"web": 1.0, "code": 1.0}},
        ],
    )
    with pytest.raises(PlanError, match=r"source 'code' is empty .* positive weight from step 1"):
        make_plan(spec, index={"web": index_of([10] * 500), "code": index_of(lengths)})


def test_empty_source_with_zero_weight_is_fine(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    spec = spec_of(tmp_path, ["web", "code"], weights={"web": 1.0, "code": 0.0})
    res = make_plan(spec, index={"web": index_of([10] * 500), "code": index_of([])})
    assert res.meta.summary["mixture"]["code"]["tokens"] == 0


def test_schedule_beyond_steps_is_refused_by_the_spec(tmp_path: Path, spec_of: Callable[..., Any]) -> None:
    with pytest.raises(SpecError, match=r"schedule\[1\].step: 10 is beyond training.steps \(10\)"):
        spec_of(
            tmp_path,
            ["web"],
            steps=10,
            schedule=[{"step": 0, "weights": {"web": 1.0}}, {"step": 10, "weights": {"web": 1.0}}],
        )


def test_fill_sets_the_step_budget(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    spec = spec_of(tmp_path, ["web"], seq_len=64, dp=2, micro_batches=2, steps=5)
    half = spec.model_copy(update={"planning": spec.planning.model_copy(update={"fill": 0.5})})
    full, low = (make_plan(s, index={"web": index_of([8] * 2000)}).meta for s in (spec, half))
    assert (full.parameters.step_budget_tokens, low.parameters.step_budget_tokens) == (245, 128)
    assert low.summary["tokens"] == 5 * 128 < full.summary["tokens"]


def test_max_epochs_names_source_and_step(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    # 4 ranks * 2 micro-batches * 128 tokens * 0.96 = 983 tokens a step, half from `small` (1000 tokens/epoch)
    spec = spec_of(tmp_path, ["web", "small"], max_epochs={"small": 2}, steps=10)
    with pytest.raises(PlanError, match=r"source 'small' would exceed max_epochs=2 at step 4 .*needs 4.9"):
        make_plan(spec, index={"web": index_of([10] * 1000), "small": index_of([10] * 100)})


def test_a_budget_below_every_document_draws_one_a_step(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any
) -> None:
    # one slot of 64 tokens a step (budget 61) but every document is a whole 64-token sequence: the nearest rule
    # leaves a step empty now and then, the fill draws the next document there (it used to be refused)
    spec = spec_of(tmp_path, ["web"], seq_len=64, dp=1, micro_batches=1, steps=40)
    res = make_plan(spec, index={"web": index_of([64] * 100)})
    step = read_manifest(res.plan_dir, res.meta)["step"].to_numpy()
    assert (np.bincount(step, minlength=40) == 1).all()


def test_a_stream_run_out_refuses_the_step(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    # the same, 101 steps: each draws one of the 100 documents its stream is built to (its targets need 97)
    spec = spec_of(tmp_path, ["web"], seq_len=64, dp=1, micro_batches=1, steps=101)
    with pytest.raises(PlanError, match=r"step 100 draws no document: source 'web', weighted at that step, has drawn"):
        make_plan(spec, index={"web": index_of([64] * 100)})


def test_a_plan_is_the_prefix_of_a_longer_one_or_refused(
    tmp_path: Path, spec_of: Callable[..., Any], index_of: Any
) -> None:
    """Fills at a budget below the documents draw a source past its targets; where one runs out of the stream a
    fresh plan built (to its own final targets), the step is refused, never filled from another source: so a plan
    that plans is the prefix of a longer one, and its re-plan never places a document twice."""
    index = {"a": index_of([64] * 50), "b": index_of([64] * 1000)}

    def rows(steps: int, resume: Any = None) -> Any:
        spec = spec_of(
            tmp_path / str(steps) / str(resume is not None), ["a", "b"], seq_len=64, dp=1, micro_batches=1, steps=steps
        )
        spec = spec.model_copy(update={"planning": spec.planning.model_copy(update={"lookahead": 0})})
        res = make_plan(spec, index=index, resume_from=resume)
        m = read_manifest(res.plan_dir, res.meta)
        return res, m.select(["step", "source", "sample"]).to_pylist()

    _, long_rows = rows(110)
    planned = refused = 0
    for steps in (60, 99, 102, 105):
        try:
            res, got = rows(steps)
        except PlanError as e:
            assert "has drawn past the data its share needs" in str(e)
            refused += 1
            continue
        planned += 1
        assert got == [r for r in long_rows if r["step"] < steps]
        _, again = rows(110, PlanResume(plan_dir=res.plan_dir, at_step=steps - 1))  # extended from its last step
        assert again == long_rows
    assert planned and refused  # both outcomes met (60 plans; 102 runs out of a's stream)


def test_sample_with_images_larger_than_any_lane(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    spec = spec_of(tmp_path, ["caps"], seq_len=128)
    lengths = np.full(20, 50)
    images = np.full(20, 30)
    lengths[7], images[7] = 300, 256
    with pytest.raises(PlanError, match=r"source 'caps', sample 7: 300 tokens with 256 image tokens exceed"):
        make_plan(spec, index={"caps": index_of(lengths, images)})


def test_more_image_samples_than_sequences_can_take(tmp_path: Path, spec_of: Callable[..., Any], index_of: Any) -> None:
    # every 40-token image sample needs a 64-token sequence of its own, but a step draws 3 for 2 sequences
    spec = spec_of(tmp_path, ["caps"], seq_len=64, dp=1, micro_batches=2, steps=20)
    with pytest.raises(PlanError, match=r"step \d+: \d+ samples with images found no room .* raise micro_batches"):
        make_plan(spec, index={"caps": index_of(np.full(100, 40), np.full(100, 30))})


def _carry_segments(image_tokens: list[int]) -> Any:
    from loomdata.planning._segments import Segments

    n = len(image_tokens)
    return Segments(
        np.zeros(n, dtype=np.uint16),
        np.arange(n, dtype=np.uint64),
        np.zeros(n, dtype=np.uint32),
        np.full(n, 40, dtype=np.int64),
        np.zeros(n, dtype=np.uint8),
        np.array(image_tokens, dtype=np.uint32),
    )


@pytest.mark.parametrize(
    ("image_tokens", "says"),
    [
        ([30, 30, 30, 30], r"step 7: 3 samples with images found no room .* raise micro_batches"),
        (
            [0, 0, 0, 0],
            r"step 7: 3 segments \(120 tokens, 0 of them samples with images\) found no room .* planning\.fill",
        ),
        ([30, 0, 30, 0], r"step 7: 3 segments \(120 tokens, 1 of them samples with images\) found no room .* image"),
    ],
)
def test_a_carry_past_the_sequences_names_what_it_holds(image_tokens: list[int], says: str) -> None:
    # the balancer's refusal blamed images for a text carry too (a step overfilled by membership or the look-ahead)
    from loomdata.planning.balance._block import _block_end

    segs = _carry_segments(image_tokens)
    rests = np.array([[1, 0, 40], [2, 0, 40], [3, 0, 40]], dtype=np.int64)  # three wholly deferred, two sequences
    with pytest.raises(PlanError, match=says):
        _block_end(0, rests, segs, np.array([0, 4]), range(7, 8), slots=2)

"""The data-plane spec: valid specs load into frozen models; every problem is reported with its key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from loomdata.schemas import SourceFormat, Spec, SpecError, load_spec, parse_spec


def _write(tmp: Path, rel: str) -> None:
    p = tmp / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")


def _base(tmp: Path) -> dict[str, Any]:
    _write(tmp, "data/web/a.parquet")
    _write(tmp, "data/code/a.parquet")
    _write(tmp, "data/books/a.jsonl")
    _write(tmp, "data/papers/p.idx")
    _write(tmp, "data/papers/p.bin")
    return {
        "name": "t",
        "workdir": "./work",
        "seed": 7,
        "sources": [
            {"name": "web", "format": "parquet", "paths": ["data/web/*.parquet"], "tokens_field": "input_ids"},
            {"name": "code", "format": "parquet", "paths": ["data/code/*.parquet"], "text_field": "text"},
            {"name": "books", "format": "jsonl", "paths": ["data/books/*.jsonl"], "text_field": "text"},
            {"name": "papers", "format": "megatron", "paths": ["data/papers/p"]},
        ],
        "mixture": {"weights": {"web": 0.5, "code": 0.3, "books": 0.1, "papers": 0.1}},
        "training": {"seq_len": 1024, "steps": 100, "dp_size": 4, "micro_batches": 2},
    }


def _problems(data: dict[str, Any], tmp: Path) -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec(data, tmp)
    return exc.value.problems


def test_valid_spec_resolves_paths_and_is_frozen(tmp_path: Path) -> None:
    spec = parse_spec(_base(tmp_path), tmp_path)
    assert spec.workdir == (tmp_path / "work").resolve()
    assert spec.source("papers").format is SourceFormat.MEGATRON
    assert spec.resolve_paths(spec.source("papers")) == [(tmp_path / "data/papers/p").resolve()]
    assert spec.resolve_paths(spec.source("web")) == [(tmp_path / "data/web/a.parquet").resolve()]
    with pytest.raises(pydantic.ValidationError):
        spec.seed = 3  # type: ignore[misc]


def test_spec_hash_is_stable_and_sensitive(tmp_path: Path) -> None:
    a = parse_spec(_base(tmp_path), tmp_path)
    b = parse_spec(_base(tmp_path), tmp_path)
    assert a.spec_hash() == b.spec_hash()
    data = _base(tmp_path)
    data["seed"] = 8
    assert parse_spec(data, tmp_path).spec_hash() != a.spec_hash()


def test_every_problem_listed_with_key_path(tmp_path: Path) -> None:
    data = _base(tmp_path)
    data["sources"][2]["paths"] = ["data/x/*.parquet"]
    data["mixture"] = {
        "schedule": [
            {"step": 0, "weights": {"web": 1.0, "cod": 0.5}},
            {"step": 0, "weights": {"web": -1.0}},
            {"step": 500, "weights": {"web": 0.0, "code": 0.0}},
        ]
    }
    problems = _problems(data, tmp_path)
    text = "\n".join(problems)
    assert "sources[2].paths[0]: no file matches 'data/x/*.parquet'" in text
    assert "mixture.schedule[0].weights.cod: unknown source 'cod' (known: web, code, books, papers)" in text
    assert "mixture.schedule[1].weights.web: weight must be a finite number >= 0, got -1.0" in text
    assert "mixture.schedule[1].step: steps must increase (0 then 0)" in text
    assert "mixture.schedule[2].weights: all weights are zero" in text
    assert "mixture.schedule[2].step: 500 is beyond training.steps (100)" in text
    assert len(problems) == 6


def test_structural_errors_name_their_keys(tmp_path: Path) -> None:
    data = _base(tmp_path)
    data["training"] = {"seq_len": 0, "steps": -1, "dp_size": 0}
    data["sources"][0]["format"] = "csv"
    text = "\n".join(_problems(data, tmp_path))
    for key in ("training.seq_len", "training.steps", "training.dp_size", "sources[0].format"):
        assert key in text


def test_missing_fields_and_mixture_shape(tmp_path: Path) -> None:
    data = _base(tmp_path)
    del data["sources"][1]["text_field"]
    data["mixture"] = {"weights": {"web": 1.0}, "schedule": [{"step": 0, "weights": {"web": 1.0}}]}
    text = "\n".join(_problems(data, tmp_path))
    assert "sources[1]: a parquet source needs `tokens_field` or `text_field`" in text
    assert "mixture: give exactly one of `weights` or `schedule`" in text


def test_megatron_prefix_without_bin_is_reported(tmp_path: Path) -> None:
    data = _base(tmp_path)
    (tmp_path / "data/papers/p.bin").unlink()
    assert any("sources[3].paths[0]: no .idx/.bin pair matches" in p for p in _problems(data, tmp_path))


def test_long_context_checks(tmp_path: Path) -> None:
    data = _base(tmp_path)
    data["long_context"] = {"threshold": 5000, "seq_len": 512, "cp_size": 3}
    text = "\n".join(_problems(data, tmp_path))
    assert "long_context.seq_len: 512 must exceed training.seq_len (1024)" in text
    assert "long_context.threshold" in text
    assert "not divisible by cp_size" in text


def test_load_spec_from_yaml_and_bad_yaml(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(_base(tmp_path)))
    spec = load_spec(f)
    assert isinstance(spec, Spec) and spec.base_dir == tmp_path.resolve()
    f.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(f)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "nope.yaml")


def test_example_spec_shape_validates_without_paths() -> None:
    example = Path("/work/shared/examples/spec.yaml")
    if not example.exists():
        pytest.skip("shared example spec not present")
    spec = load_spec(example, check_paths=False)
    assert spec.source("captions").image_field == ["jpg"]
    assert spec.long_context is not None and spec.long_context.cp_size == 8


def test_metadata_checked_per_format(tmp_path: Path) -> None:
    data = _base(tmp_path)
    data["sources"][0]["metadata"] = ["url", "row"]  # parquet: any column, but not an index column
    data["sources"][2]["metadata"] = ["lang", "num_tokens", "lang", ""]  # jsonl
    data["sources"][3]["metadata"] = ["document", "title", "sample"]  # megatron: only `document`
    problems = _problems(data, tmp_path)
    text = "\n".join(problems)
    clash = "clashes with an index column (sample, shard, row, num_tokens, num_image_tokens, checksum)"
    assert f"sources[0].metadata[1]: 'row' {clash}; rename it in the files or drop it from `metadata`" in text
    assert f"sources[2].metadata[1]: 'num_tokens' {clash}" in text
    assert "sources[2].metadata[2]: 'lang' is listed twice; list each column once" in text
    assert "sources[2].metadata[3]: empty column name" in text
    assert (
        "sources[3].metadata[1]: a megatron source carries only 'document' (each sequence's document number), "
        "not 'title'; drop it from `metadata`"
    ) in text
    assert f"sources[3].metadata[2]: 'sample' {clash}" in text
    assert len(problems) == 6


def test_metadata_each_format_can_carry_is_accepted(tmp_path: Path) -> None:
    _write(tmp_path, "data/caps/0.tar")
    data = _base(tmp_path)
    data["sources"][0]["metadata"] = ["url", "input_ids"]
    data["sources"][2]["metadata"] = ["url", "lang", "quality", "text"]
    data["sources"][3]["metadata"] = ["document"]
    data["sources"].append(
        {
            "name": "caps",
            "format": "webdataset",
            "paths": ["data/caps/*.tar"],
            "text_field": "txt",
            "metadata": ["__key__", "json"],
        }
    )
    spec = parse_spec(data, tmp_path)
    assert spec.source("books").metadata == ["url", "lang", "quality", "text"]
    assert spec.source("caps").metadata == ["__key__", "json"]

"""The per-format field rules: one table, and spec validation and the readers agree with it everywhere."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from loomdata.schemas.errors import SourceDataError, SpecError
from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec, parse_spec
from loomdata.sources import FIELD_RULES, field_problems, make_reader, metadata_problem

GRID = list(
    itertools.product(
        [f.value for f in SourceFormat],
        [None, "ids"],  # tokens_field
        [None, "", "text"],  # text_field
        [[], ["jpg"]],  # image_field
        [[], ["document"], ["url"], ["document", "lang"]],  # metadata (no index columns, no repeats)
    )
)


def _source(fmt: str, tokens: str | None, text: str | None, images: list[str], meta: list[str]) -> dict[str, Any]:
    return {
        "name": "s",
        "format": fmt,
        "paths": ["x"],
        "tokens_field": tokens,
        "text_field": text,
        "image_field": images,
        "metadata": meta,
    }


def _spec_problems(source: dict[str, Any]) -> list[str]:
    data = {
        "name": "t",
        "workdir": "w",
        "sources": [source],
        "mixture": {"weights": {"s": 1.0}},
        "training": {"seq_len": 8, "steps": 1, "dp_size": 1},
    }
    try:
        parse_spec(data, Path("."), check_paths=False)
    except SpecError as e:
        return e.problems
    return []


def test_every_format_has_rules() -> None:
    assert set(FIELD_RULES) == {f.value for f in SourceFormat}


@pytest.mark.parametrize(("fmt", "tokens", "text", "images", "meta"), GRID)
def test_spec_and_readers_follow_the_one_table(
    fmt: str, tokens: str | None, text: str | None, images: list[str], meta: list[str]
) -> None:
    raw = _source(fmt, tokens, text, images, meta)
    source = SourceSpec.model_validate(raw)
    want = field_problems(source, "sources[0]")
    for j, m in enumerate(meta):
        why = metadata_problem(fmt, m)
        if why is not None:
            want.append(f"sources[0].metadata[{j}]: {why}")
    assert _spec_problems(raw) == want
    if want:
        with pytest.raises(SourceDataError, match=r"^<source s>: .*fix the source in the spec") as e:
            make_reader(source, TokenizerSpec(), ImageSpec())
        assert e.value.path == "<source s>"
        assert all(w.split(": ", 1)[1] in e.value.reason for w in want)
    else:
        make_reader(source, TokenizerSpec(), ImageSpec()).close()


def test_the_messages_spec_users_see() -> None:
    def problems(**kw: Any) -> list[str]:
        base: dict[str, Any] = {"name": "s", "format": "parquet", "paths": ["x"]}
        return field_problems(SourceSpec.model_validate({**base, **kw}), "sources[2]")

    assert problems() == ["sources[2]: a parquet source needs `tokens_field` or `text_field`"]
    assert problems(format="jsonl") == ["sources[2].text_field: required for format jsonl"]
    both = "sources[2]: set either `tokens_field` or `text_field`, not both"
    assert problems(tokens_field="a", text_field="b") == [both]
    assert problems(text_field="t", image_field="jpg") == [
        "sources[2].image_field: images are supported for webdataset sources only"
    ]
    assert problems(format="megatron") == []
    assert metadata_problem("megatron", "title") == (
        "a megatron source carries only 'document' (each sequence's document number), not 'title'; "
        "drop it from `metadata`"
    )
    assert metadata_problem("megatron", "document") is None
    assert metadata_problem("webdataset", "__key__") is None

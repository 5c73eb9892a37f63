"""The plain records serving workers read: their defaults are the spec models', and plan.json's fields come back as
the validated models give them (a field absent from the JSON falls back to the record's own default)."""

from __future__ import annotations

from typing import Any

import pytest

from loomdata.schemas.records import CostModel, ImageRecord, SourceRecord, TokenizerRecord
from loomdata.schemas.spec import CostSpec, ImageSpec, SourceSpec, TokenizerSpec


def test_the_records_defaults_are_the_specs() -> None:
    assert TokenizerRecord() == TokenizerRecord.from_spec(TokenizerSpec())
    assert ImageRecord() == ImageRecord.from_spec(ImageSpec())
    assert CostModel() == CostModel.from_spec(CostSpec())
    spec = SourceSpec(name="s", format="parquet", paths=["x"], tokens_field="ids")
    assert SourceRecord(name="s", format=spec.format, tokens_field="ids") == SourceRecord.from_spec(spec)


@pytest.mark.parametrize(
    ("record", "model"),
    [
        (TokenizerRecord, TokenizerSpec(kind="huggingface", path="/tmp/tok.json", pad_token_id=3)),
        (ImageRecord, ImageSpec(patch_size=16, max_pixels=1024, placeholder_token_id=7)),
        (CostModel, CostSpec(attention=2.0, encoder=0.5, encoder_window=64, balance="both")),
        (
            SourceRecord,
            SourceSpec(
                name="s",
                format="webdataset",
                paths=["x"],
                text_field="txt",
                image_field=["jpg"],
                on_error="skip",
                verify="shard",
            ),
        ),
    ],
    ids=["tokenizer", "images", "cost", "source"],
)
def test_from_json_equals_from_spec(record: Any, model: Any) -> None:
    """A model's JSON dump (as plan.json holds it) reads back as the record made from the model itself; with every
    optional field dropped from the JSON, as the record's defaults (the spec's, above)."""
    dump = model.model_dump(mode="json")
    assert record.from_json(dump) == record.from_spec(model)
    bare = {k: v for k, v in dump.items() if k in ("name", "format")}  # a source's required fields; else none
    want = record(name=model.name, format=model.format) if bare else record()
    assert record.from_json(bare) == want

"""Source formats: one module per format behind one small protocol (`FormatReader`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from loomdata.schemas.formats import FIELD_RULES, FieldRules, check_fields, field_problems, metadata_problem
from loomdata.schemas.records import SourceFormat
from loomdata.sources._base import (
    FormatReader,
    KeptRows,
    LruUnitCache,
    Sample,
    ScanResult,
    TokenSpans,
    UnitCache,
    UnitKey,
)

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages, AnySource, AnyTokenizer

__all__ = [
    "FIELD_RULES",
    "FieldRules",
    "FormatReader",
    "KeptRows",
    "LruUnitCache",
    "Sample",
    "ScanResult",
    "TokenSpans",
    "UnitCache",
    "UnitKey",
    "check_fields",
    "field_problems",
    "make_reader",
    "metadata_problem",
]

_READERS: dict[SourceFormat, tuple[str, str]] = {
    SourceFormat.PARQUET: ("loomdata.sources.parquet", "ParquetReader"),
    SourceFormat.JSONL: ("loomdata.sources.jsonl", "JsonlReader"),
    SourceFormat.MEGATRON: ("loomdata.sources.megatron", "MegatronReader"),
    SourceFormat.WEBDATASET: ("loomdata.sources.webdataset", "WebDatasetReader"),
}


def make_reader(source: AnySource, tokenizer: AnyTokenizer, images: AnyImages) -> FormatReader:
    """A fresh reader for `source`'s format (imported lazily: a loader only loads what it serves)."""
    module, name = _READERS[source.format]
    cls: type[FormatReader] = getattr(importlib.import_module(module), name)
    return cls(source, tokenizer, images)

"""Which fields each source format accepts: the one table that spec validation and the readers share.

A source names its content with `tokens_field` (a pre-tokenized list column) or `text_field` (raw
text), its images with `image_field`, and the columns it carries into the index with `metadata`.
What a format accepts is declared once here, as data (`FIELD_RULES`, keyed by the format's value):

- `content`: the fields that may hold a sample's content; exactly one of them must be set (none for
  Megatron, whose token files are the content);
- `images`: whether `image_field` may list image members;
- `metadata`: the only metadata columns the format can carry (name -> what it holds), or None for
  any field of the files.

`field_problems` and `metadata_problem` turn the table into the messages `load_spec` reports;
`check_fields` raises them as one SourceDataError when a reader is made for a source that skipped
validation. It lives in `schemas` (the one package every stage may import) and imports nothing of
loomdata at run time but `schemas.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Protocol

from loomdata.schemas.errors import SourceDataError


class SourceSpec(Protocol):
    """The fields of `spec.SourceSpec` these rules read (a Protocol: importing spec here would be a circle)."""

    @property
    def name(self) -> str: ...
    @property
    def format(self) -> Enum: ...
    @property
    def tokens_field(self) -> str | None: ...
    @property
    def text_field(self) -> str | None: ...
    @property
    def image_field(self) -> object: ...
    @property
    def metadata(self) -> Sequence[str]: ...


__all__ = ["DOCUMENT_COLUMN", "FIELD_RULES", "FieldRules", "check_fields", "field_problems", "metadata_problem"]

DOCUMENT_COLUMN = "document"
"""The one metadata column a Megatron source can carry: the document number of each sequence."""

_CONTENT_FIELDS = ("tokens_field", "text_field")


@dataclass(frozen=True, slots=True)
class FieldRules:
    """What one format accepts: which fields may hold the content, whether images, which metadata."""

    content: tuple[str, ...]
    images: bool = False
    metadata: Mapping[str, str] | None = None


FIELD_RULES: Mapping[str, FieldRules] = MappingProxyType(
    {
        "parquet": FieldRules(content=("tokens_field", "text_field")),
        "jsonl": FieldRules(content=("text_field",)),
        "webdataset": FieldRules(content=("text_field",), images=True),
        "megatron": FieldRules(
            content=(), metadata=MappingProxyType({DOCUMENT_COLUMN: "each sequence's document number"})
        ),
    }
)
"""The field rules of every format, keyed by `SourceFormat.value`."""


def _problems(source: SourceSpec) -> list[tuple[str | None, str]]:
    """(field at fault or None for the source as a whole, what is wrong) for the content and image fields."""
    fmt = source.format.value
    rules = FIELD_RULES[fmt]
    out: list[tuple[str | None, str]] = []
    if rules.content and not any(getattr(source, f) for f in rules.content):
        if len(rules.content) == 1:
            out.append((rules.content[0], f"required for format {fmt}"))
        else:
            out.append((None, f"a {fmt} source needs {' or '.join(f'`{f}`' for f in rules.content)}"))
    if all(getattr(source, f) for f in _CONTENT_FIELDS):
        out.append((None, "set either `tokens_field` or `text_field`, not both"))
    if source.image_field and not rules.images:
        with_images = ", ".join(name for name, r in FIELD_RULES.items() if r.images)
        out.append(("image_field", f"images are supported for {with_images} sources only"))
    return out


def field_problems(source: SourceSpec, key: str) -> list[str]:
    """Problems of `source`'s content and image fields, each prefixed by the source's key path `key`."""
    return [f"{key}.{f}: {why}" if f else f"{key}: {why}" for f, why in _problems(source)]


def metadata_problem(fmt: str, column: str) -> str | None:
    """Why a source of format `fmt` (a `SourceFormat` value) cannot carry metadata `column`, or None."""
    allowed = FIELD_RULES[fmt].metadata
    if allowed is None or column in allowed:
        return None
    which = ", ".join(f"{name!r} ({what})" for name, what in allowed.items())
    return f"a {fmt} source carries only {which}, not {column!r}; drop it from `metadata`"


def check_fields(source: SourceSpec) -> None:
    """Raise one SourceDataError listing every field `source`'s format does not accept (as `load_spec` would)."""
    problems = [f"`{f}`: {why}" if f else why for f, why in _problems(source)]
    for m in source.metadata:
        why = metadata_problem(source.format.value, m)
        if why is not None:
            problems.append(f"`metadata` {m!r}: {why}")
    if problems:
        raise SourceDataError(
            f"<source {source.name}>",
            "; ".join(problems),
            hint="fix the source in the spec; `load_spec` reports the same problems",
        )

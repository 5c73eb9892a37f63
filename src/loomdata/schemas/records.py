"""Plain records of the spec for the processes that only serve it: no pydantic.

A Dask worker's Source Loaders and Data Constructors read a few fields of a validated spec (a source's format
and fields, the tokenizer, the image rule, the cost model). Importing the pydantic models for them cost each
serving worker ~8 MiB of private memory (session 18), so workers get these frozen dataclasses instead, built
from plan.json that the serving process validated (`plan_view`) or from the models (`from_spec`). The enums live here
and `spec` re-exports them: one class each, so `is` comparisons hold across both.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "AnyImages",
    "AnySource",
    "AnyTokenizer",
    "CostBalance",
    "CostModel",
    "CostTerms",
    "ImageRecord",
    "OnError",
    "ShuffleMode",
    "SourceFormat",
    "SourceRecord",
    "TokenizerKind",
    "TokenizerRecord",
    "VerifyMode",
    "cost_of",
    "cost_parts",
]


class SourceFormat(str, enum.Enum):
    """On-disk formats loomdata can index and read."""

    PARQUET = "parquet"
    JSONL = "jsonl"
    WEBDATASET = "webdataset"
    MEGATRON = "megatron"


class OnError(str, enum.Enum):
    """What to do with a bad shard or sample: stop the job, or skip it (counted and listed)."""

    ERROR = "error"
    SKIP = "skip"


class ShuffleMode(str, enum.Enum):
    """How a source's stream orders its documents each epoch: one global permutation, or blocks of storage."""

    GLOBAL = "global"
    BLOCK = "block"


class VerifyMode(str, enum.Enum):
    """What a Source Loader checks against the index: each sample's checksum and its shard, the shard only, nothing."""

    SAMPLE = "sample"
    SHARD = "shard"
    OFF = "off"


class TokenizerKind(str, enum.Enum):
    """How raw text becomes tokens."""

    BYTES = "bytes"
    HUGGINGFACE = "huggingface"


class CostBalance(str, enum.Enum):
    """What the balancer equalizes: the summed cost of a rank (`sum`), or its encoder and backbone parts
    apart (`both`: the vision encoder and the language backbone run on different stages or devices, so a
    step takes as long as the slower of the two stages)."""

    SUM = "sum"
    BOTH = "both"


class AnyTokenizer(Protocol):
    """A tokenizer's fields: a validated `TokenizerSpec` or its `TokenizerRecord` (a Protocol: no import of spec)."""

    @property
    def kind(self) -> TokenizerKind: ...
    @property
    def path(self) -> Path | None: ...
    @property
    def pad_token_id(self) -> int: ...
    def __hash__(self) -> int: ...  # readers cache a tokenizer per spec


class AnyImages(Protocol):
    """The image rule's fields: a validated `ImageSpec` or its `ImageRecord`."""

    @property
    def patch_size(self) -> int: ...
    @property
    def max_pixels(self) -> int: ...
    @property
    def placeholder_token_id(self) -> int: ...


class AnySource(Protocol):
    """What a reader is built from: a validated `SourceSpec` (indexing) or its `SourceRecord` (serving)."""

    @property
    def name(self) -> str: ...
    @property
    def format(self) -> SourceFormat: ...
    @property
    def tokens_field(self) -> str | None: ...
    @property
    def text_field(self) -> str | None: ...
    @property
    def image_field(self) -> Sequence[str]: ...
    @property
    def metadata(self) -> Sequence[str]: ...
    @property
    def on_error(self) -> OnError: ...
    @property
    def verify(self) -> VerifyMode: ...
    @property
    def storage_options(self) -> Mapping[str, Mapping[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class TokenizerRecord:
    """`TokenizerSpec`'s fields, plain."""

    kind: TokenizerKind = TokenizerKind.BYTES
    path: Path | None = None
    pad_token_id: int = 0

    @classmethod
    def from_spec(cls, spec: AnyTokenizer) -> TokenizerRecord:
        """The record of a validated `TokenizerSpec` (a record is returned as is)."""
        if isinstance(spec, TokenizerRecord):
            return spec
        return cls(spec.kind, spec.path, spec.pad_token_id)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TokenizerRecord:
        """The record of a tokenizer as plan.json holds it (a field absent: the record's default)."""
        return cls(**_present(raw, kind=TokenizerKind, path=_optional(Path), pad_token_id=int))


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """`ImageSpec`'s fields, plain."""

    patch_size: int = 14
    max_pixels: int = 200704
    placeholder_token_id: int = 32000

    @classmethod
    def from_spec(cls, spec: AnyImages) -> ImageRecord:
        """The record of a validated `ImageSpec` (a record is returned as is)."""
        if isinstance(spec, ImageRecord):
            return spec
        return cls(spec.patch_size, spec.max_pixels, spec.placeholder_token_id)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ImageRecord:
        """The record of an image rule as plan.json holds it (a field absent: the record's default)."""
        return cls(**_present(raw, patch_size=int, max_pixels=int, placeholder_token_id=int))


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """The fields of a `SourceSpec` a reader and a loader use (not the planning ones: paths, epochs, shuffle).

    `storage_options` is never shown (repr) nor compared: it may hold secrets, and plan.json never has it.
    """

    name: str
    format: SourceFormat
    tokens_field: str | None = None
    text_field: str | None = None
    image_field: tuple[str, ...] = ()
    metadata: tuple[str, ...] = ()
    on_error: OnError = OnError.ERROR
    verify: VerifyMode = VerifyMode.SAMPLE
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_spec(cls, spec: AnySource) -> SourceRecord:
        """The record of a validated `SourceSpec`, its storage options included (a record is returned as is)."""
        if isinstance(spec, SourceRecord):
            return spec
        return cls(
            name=spec.name,
            format=spec.format,
            tokens_field=spec.tokens_field,
            text_field=spec.text_field,
            image_field=tuple(spec.image_field),
            metadata=tuple(spec.metadata),
            on_error=spec.on_error,
            verify=spec.verify,
            storage_options={p: dict(kw) for p, kw in spec.storage_options.items()},
        )

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SourceRecord:
        """The record of a source as plan.json holds it (a validated spec's dump: no storage options; a field other
        than `name` and `format` absent: the record's default)."""
        return cls(
            name=str(raw["name"]),
            format=SourceFormat(raw["format"]),
            **_present(
                raw,
                tokens_field=_optional(str),
                text_field=_optional(str),
                image_field=lambda v: tuple(v or ()),
                metadata=lambda v: tuple(v or ()),
                on_error=OnError,
                verify=VerifyMode,
            ),
        )


def _present(raw: Mapping[str, Any], **convert: Callable[[Any], Any]) -> dict[str, Any]:
    """The fields of `raw` named in `convert` that it holds, each converted: a record's own defaults stand for the rest
    (one copy of each default, the record's)."""
    return {k: f(raw[k]) for k, f in convert.items() if k in raw}


def _optional(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`f`, passing None through."""
    return lambda v: None if v is None else f(v)


class CostTerms(Protocol):
    """The terms of the cost formula (`CostSpec`, validated; `CostModel`, plain)."""

    @property
    def attention(self) -> float: ...
    @property
    def linear(self) -> float: ...
    @property
    def encoder(self) -> float: ...
    @property
    def encoder_linear(self) -> float: ...
    @property
    def encoder_window(self) -> int | None: ...
    @property
    def balance(self) -> CostBalance: ...


def _has_encoder(c: CostTerms) -> bool:
    return bool(c.encoder or c.encoder_linear)


def _encoder_raw(c: CostTerms, img: np.ndarray) -> np.ndarray:
    """The encoder part of a segment with `img` image tokens, before the cp split."""
    window = img if c.encoder_window is None else np.minimum(img, float(c.encoder_window))
    out = c.encoder * img * window
    return out + c.encoder_linear * img if c.encoder_linear else out


def cost_of(c: CostTerms, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> np.ndarray:
    """Cost (float64) of each segment of `lengths` tokens (with `image_tokens`) on one rank of its cp group.

    The one formula (`CostSpec.of`, `CostModel.of`): the planner balances it, serving predicts step times with it.
    """
    n = np.asarray(lengths, dtype=np.float64)
    out = c.attention * n * n + c.linear * n
    if image_tokens is not None and _has_encoder(c):
        out = out + _encoder_raw(c, np.asarray(image_tokens, dtype=np.float64))
    return out / np.asarray(cp_size, dtype=np.float64)


def cost_parts(c: CostTerms, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> tuple[np.ndarray, np.ndarray]:
    """(backbone, encoder) cost (float64) of each segment on one rank of its cp group; they add up to `cost_of`
    (up to rounding). A cp group splits its sequence's images over its peers' encoder too."""
    n = np.asarray(lengths, dtype=np.float64)
    cp = np.asarray(cp_size, dtype=np.float64)
    backbone = (c.attention * n * n + c.linear * n) / cp
    if image_tokens is None or not _has_encoder(c):
        return backbone, np.zeros(np.broadcast_shapes(n.shape, cp.shape))
    return backbone, _encoder_raw(c, np.asarray(image_tokens, dtype=np.float64)) / cp


@dataclass(frozen=True, slots=True)
class CostModel:
    """`CostSpec`'s terms, plain, with the same formula (`cost_of`): what a constructor predicts step costs with."""

    attention: float = 1.0
    linear: float = 24576.0
    encoder: float = 0.0
    encoder_linear: float = 0.0
    encoder_window: int | None = None
    balance: CostBalance = CostBalance.SUM

    @classmethod
    def from_spec(cls, spec: CostTerms) -> CostModel:
        """The model of a validated `CostSpec` (a model is returned as is)."""
        if isinstance(spec, CostModel):
            return spec
        return cls(spec.attention, spec.linear, spec.encoder, spec.encoder_linear, spec.encoder_window, spec.balance)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CostModel:
        """The model of a cost as plan.json holds it (a `CostSpec` dump; a term absent: the model's default)."""
        return cls(
            **_present(
                raw,
                attention=float,
                linear=float,
                encoder=float,
                encoder_linear=float,
                encoder_window=_optional(int),
                balance=CostBalance,
            )
        )

    @property
    def has_encoder(self) -> bool:
        """Whether image tokens cost anything (an encoder part exists)."""
        return _has_encoder(self)

    def of(self, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> np.ndarray:
        """`cost_of` these segments (as `CostSpec.of`)."""
        return cost_of(self, lengths, image_tokens, cp_size)

    def parts(self, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> tuple[np.ndarray, np.ndarray]:
        """`cost_parts` of these segments (as `CostSpec.parts`)."""
        return cost_parts(self, lengths, image_tokens, cp_size)

"""The data-plane spec: YAML validated into frozen pydantic models.

`load_spec` reports every problem at once, each with its key path (for example
`sources[2].paths: no file matches 'data/x/*.parquet'`), as one `SpecError`.
Relative paths are resolved against the spec file's folder.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from loomdata.schemas.errors import SpecError
from loomdata.schemas.formats import field_problems, metadata_problem
from loomdata.schemas.records import (
    CostBalance,
    OnError,
    ShuffleMode,
    SourceFormat,
    TokenizerKind,
    VerifyMode,
    cost_of,
    cost_parts,
)
from loomdata.schemas.tables import INDEX_COLUMNS

__all__ = [
    "CostBalance",
    "CostSpec",
    "ImageSpec",
    "LongContextSpec",
    "Milestone",
    "MixtureSpec",
    "OnError",
    "ShuffleMode",
    "SourceFormat",
    "SourceSpec",
    "Spec",
    "TokenizerKind",
    "TokenizerSpec",
    "TrainingSpec",
    "VerifyMode",
    "load_spec",
    "parse_spec",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


class TokenizerSpec(_Frozen):
    """`bytes` (built-in byte-level, no files) or `huggingface` (a tokenizer.json)."""

    kind: TokenizerKind = TokenizerKind.BYTES
    path: Path | None = None
    pad_token_id: int = Field(default=0, ge=0)
    """Token id written into a batch's padding positions (their labels are ignored, so only the id matters)."""


class SourceSpec(_Frozen):
    """One data source: a name, a format, where its files are, and which fields hold its content."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    format: SourceFormat
    paths: list[str] = Field(min_length=1)
    tokens_field: str | None = None
    text_field: str | None = None
    image_field: list[str] = Field(default_factory=list)
    metadata: list[str] = Field(default_factory=list)
    on_error: OnError = OnError.ERROR
    max_epochs: float | None = Field(default=None, gt=0)
    verify: VerifyMode = VerifyMode.SAMPLE  # a serving setting: not part of the plan id (`content_json`)
    storage_options: dict[str, dict[str, Any]] = Field(default_factory=dict, exclude=True, repr=False)
    """fsspec options per protocol for URL `paths` (`{s3: {endpoint_url: ...}}`): never dumped, shown or written."""
    shuffle: ShuffleMode = ShuffleMode.GLOBAL
    """`global`: a fresh permutation of all documents every epoch; `block`: the order of blocks of `block_size`
    documents consecutive in storage (within one shard) is shuffled every epoch and documents are shuffled
    within each `window` of consecutive blocks of that order, so a reader fetching whole blocks reads
    mostly sequentially (planning._shuffle)."""
    block_size: int | None = Field(default=None, gt=0)
    """Documents per block (shuffle: block; default 1024): about one Parquet row group or a few MiB of a file."""
    window: int | None = Field(default=None, gt=0)
    """Blocks whose documents are shuffled together (shuffle: block; default 16): a loader keeps this many."""

    BLOCK_SIZE_DEFAULT: ClassVar[int] = 1024
    WINDOW_DEFAULT: ClassVar[int] = 16
    SHUFFLE_FIELDS: ClassVar[tuple[str, ...]] = ("shuffle", "block_size", "window")
    """Left out of the plan id while `shuffle` is global, so plans made before these fields keep their ids."""

    @field_validator("image_field", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _block_fields_need_block(self) -> SourceSpec:
        """`block_size` / `window` only shape a block shuffle: with `shuffle: global` they would be ignored."""
        given = [f for f in ("block_size", "window") if getattr(self, f) is not None]
        if given and self.shuffle is not ShuffleMode.BLOCK:
            names = " and ".join(given)
            raise ValueError(
                f"{names} set, but they shape only shuffle: block (this source's shuffle is "
                f"{self.shuffle.value}); set shuffle: block or drop {names}"
            )
        return self

    @property
    def shuffle_blocks(self) -> tuple[int, int] | None:
        """(block_size, window) of a block shuffle, defaults filled in; None for the global shuffle."""
        if self.shuffle is not ShuffleMode.BLOCK:
            return None
        return (self.block_size or self.BLOCK_SIZE_DEFAULT, self.window or self.WINDOW_DEFAULT)


class ImageSpec(_Frozen):
    """How images become tokens: scale down to `max_pixels` (keep aspect), then one token per patch."""

    patch_size: int = Field(default=14, gt=0)
    max_pixels: int = Field(default=200704, gt=0)
    placeholder_token_id: int = Field(default=32000, ge=0)


class Milestone(_Frozen):
    """Mixture weights that hold at `step`; weights between milestones are interpolated linearly."""

    step: int = Field(ge=0)
    weights: dict[str, float]


class MixtureSpec(_Frozen):
    """Token shares per source: fixed `weights`, or a `schedule` of milestones (curriculum)."""

    weights: dict[str, float] | None = None
    schedule: list[Milestone] | None = None

    def milestones(self) -> list[Milestone]:
        """The mixture as a list of milestones (a fixed mixture is one milestone at step 0)."""
        if self.schedule is not None:
            return list(self.schedule)
        return [Milestone(step=0, weights=dict(self.weights or {}))]


class TrainingSpec(_Frozen):
    """Shape of the training job: sequence length, steps, and the rank layout."""

    seq_len: int = Field(gt=0)
    steps: int = Field(gt=0)
    dp_size: int = Field(gt=0)
    micro_batches: int = Field(default=1, gt=0)
    tp_size: int = Field(default=1, gt=0)
    pp_size: int = Field(default=1, gt=0)
    cp_size: int = Field(default=1, gt=0)


class LongContextSpec(_Frozen):
    """Documents longer than `threshold` tokens go to a long lane of `seq_len`, split over `cp_size` ranks."""

    threshold: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    cp_size: int = Field(default=1, gt=0)


class CostSpec(_Frozen):
    """cost(segment) = backbone + encoder part, over the lane's cp size (`of`; `parts` gives both apart).

    backbone = attention * L^2 + linear * L (L: text plus image placeholder tokens);
    encoder = encoder * I * min(I, encoder_window) + encoder_linear * I (I: the segment's image tokens,
    one per patch): each image's patches attend to one another (a ViT over one image), so a segment of k
    whole images of P patches costs k * (encoder * P^2 + encoder_linear * P). Without `encoder_window` all of
    a segment's image tokens attend together (encoder * I^2, the model before encoder parts existed).
    The encoder terms default to 0 (plans as before); for a ViT-L/14 at 448 px (1024 patches, d 1024, 24
    layers) beside a 7B backbone (d 4096, 32 layers) in these units (attention = 1 per token pair of one
    backbone) they are encoder 0.1875, encoder_linear 1152, encoder_window 1024: the values
    `balance: both` fills in when none of the three is given.
    """

    attention: float = Field(default=1.0, ge=0)
    linear: float = Field(default=24576.0, ge=0)
    encoder: float = Field(default=0.0, ge=0)
    encoder_linear: float = Field(default=0.0, ge=0)
    """Encoder cost per image token (its MLPs and projections), in the units of `linear`."""
    encoder_window: int | None = Field(default=None, gt=0)
    """Patches per image (tokens that attend together in the encoder); None: all of a segment's image tokens."""
    balance: CostBalance = CostBalance.SUM
    """`sum`: balance each rank's summed cost; `both`: minimize max(encoder max / its LB, backbone max / its LB)."""

    VIT_L14_448: ClassVar[dict[str, float | int]] = {
        "encoder": 0.1875,
        "encoder_linear": 1152.0,
        "encoder_window": 1024,
    }
    """Encoder terms of a ViT-L/14 at 448 px beside a 7B backbone (see the class docstring)."""
    _NEW_FIELDS: ClassVar[tuple[str, ...]] = ("encoder_linear", "encoder_window", "balance")
    """Left out of dumps while at their defaults, so specs and plan ids from before them stay the same."""

    @model_validator(mode="before")
    @classmethod
    def _both_defaults(cls, data: Any) -> Any:
        """`balance: both` with no encoder term given takes the ViT-L/14 448 px terms."""
        if not isinstance(data, Mapping):
            return data
        both = str(getattr(data.get("balance"), "value", data.get("balance"))) == "both"
        if both and not any(data.get(k) is not None for k in cls.VIT_L14_448):
            return {**data, **cls.VIT_L14_448}
        return data

    @model_validator(mode="after")
    def _both_needs_encoder(self) -> CostSpec:
        if self.balance is CostBalance.BOTH and not self.has_encoder:
            raise ValueError(
                "balance: both balances the encoder and the backbone apart, but the encoder terms are 0; "
                "set encoder and/or encoder_linear (or leave all three encoder keys out for the ViT-L/14 defaults)"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        out = handler(self)
        if isinstance(out, dict):
            for k in self._NEW_FIELDS:
                if k in out and getattr(self, k) == type(self).model_fields[k].default:
                    del out[k]
        return out

    @property
    def has_encoder(self) -> bool:
        """Whether image tokens cost anything (an encoder part exists)."""
        return bool(self.encoder or self.encoder_linear)

    def of(self, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> np.ndarray:
        """Cost (float64) of each segment of `lengths` tokens (with `image_tokens`) on one rank of its cp group.

        The one formula (`records.cost_of`): the planner balances it, serving predicts step times with it (the sum
        of `parts`).
        """
        return cost_of(self, lengths, image_tokens, cp_size)

    def parts(self, lengths: Any, image_tokens: Any = None, cp_size: Any = 1) -> tuple[np.ndarray, np.ndarray]:
        """(backbone, encoder) cost (float64) of each segment on one rank of its cp group; they add up to `of`
        (up to rounding). A cp group splits its sequence's images over its peers' encoder too."""
        return cost_parts(self, lengths, image_tokens, cp_size)


LOOKAHEAD_TOLERANCE = 0.0075
"""The default `planning.lookahead_tolerance` (a spec giving it keeps the plan ids of specs written before it)."""


class PlanningSpec(_Frozen):
    """Planner settings that are not the training shape."""

    fill: float = Field(default=0.96, gt=0, le=1)
    """Share of a step's slot capacity (dp * micro_batches * seq_len) the mixture draws: room to balance cost."""
    lookahead: int = Field(default=2, ge=0, le=64)
    """Look-ahead membership window K in steps: a short-lane segment longer than 0.85 of a sequence may move up
    to K steps from its natural step so that steps hold a multiple of dp of them (0: off, membership as drawn;
    2 by default: on the long-tail 4K mix mean max/LB 1.036-1.055 -> 1.012-1.016 at dp 8-512, K = 3 adds nothing)."""
    lookahead_tolerance: float = Field(default=LOOKAHEAD_TOLERANCE, gt=0, le=0.5)
    """Most sequence-long tokens the look-ahead may move ahead of or behind their natural steps, as a share of the
    tokens planned so far: it bounds how far each source's cumulative share strays from its target on any prefix.
    The default moves little where a step holds few sequence-long segments (long context, one or two micro-batches
    a rank): 32K x 1 micro-batch at dp 8 (train_throughput's mix, books 15%, 24 steps) moves none, mean max/mean
    1.69; 0.05 with `lookahead: 8` gives 1.19 for a worst mixture error of 1.33 points instead of 0.49. On the
    bench-long curriculum: `benchmarks/balance.py --configs bench-long-1mb --tolerance` (docs/planning.md)."""
    draw_window: int = Field(default=0, ge=0, le=64, exclude_if=lambda v: v == 0)
    """Windowed draw at dp 1 (planning._window): a step fills its rows from any of each source's next W not yet
    drawn segments (the least-ahead source first, first fit), not only the next one: rows hold ~98% real tokens at
    W 4-8 instead of ~90%. 0 (default): membership as drawn; left out of the spec's dumps, so plan ids and plan.json
    of specs written before it are unchanged. Every step must be at dp 1 (a PlanError otherwise)."""


class Spec(_Frozen):
    """A validated data-plane spec. `base_dir` is the folder relative paths were resolved against."""

    name: str
    workdir: Path
    seed: int = 0
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    sources: list[SourceSpec] = Field(min_length=1)
    images: ImageSpec = Field(default_factory=ImageSpec)
    mixture: MixtureSpec
    training: TrainingSpec
    long_context: LongContextSpec | None = None
    cost: CostSpec = Field(default_factory=CostSpec)
    planning: PlanningSpec = Field(default_factory=PlanningSpec)
    base_dir: Path = Path(".")

    def source(self, name: str) -> SourceSpec:
        """The source called `name` (KeyError names the known ones)."""
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"unknown source {name!r} (known: {', '.join(self.source_names)})")

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def index_dir(self) -> Path:
        return self.workdir / "index"

    @property
    def plans_dir(self) -> Path:
        return self.workdir / "plans"

    def resolve_paths(self, source: SourceSpec) -> list[Path | str]:
        """Every file (or Megatron prefix) a source's `paths` match, sorted, deduplicated (URLs stay strings)."""
        return _resolve(self.base_dir, source)

    def canonical_json(self) -> str:
        """A stable JSON form of the spec (sorted keys, absolute paths): the input of `spec_hash`."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def content_json(self) -> str:
        """Canonical JSON of what the spec asks for, without where things are: no `workdir` or `base_dir`, and of
        the tokenizer no `path` (its identity reaches a plan through the index fingerprints). Source `paths`
        stay as written (relative patterns are location-free). The plan id hashes this."""
        data = self.model_dump(
            mode="json",
            exclude={"workdir": True, "base_dir": True, "tokenizer": {"path"}, "sources": {"__all__": {"verify"}}},
        )
        for src, s in zip(data["sources"], self.sources, strict=True):
            blocks = s.shuffle_blocks
            if blocks is None:  # the default shuffle keeps the plan ids of specs written before it
                for f in SourceSpec.SHUFFLE_FIELDS:
                    src.pop(f, None)
            else:  # defaults resolved: leaving block_size out or giving its default is the same plan
                src["block_size"], src["window"] = blocks
        if data["planning"]["lookahead_tolerance"] == LOOKAHEAD_TOLERANCE:  # plan ids of specs written before it
            del data["planning"]["lookahead_tolerance"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        """A content hash of the spec, recorded in every plan."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def content_hash(self) -> str:
        """A hash of `content_json` (no location fields, no serving settings, no storage options): equal for
        the spec a plan was made from and the spec in its plan.json, wherever each was read from."""
        return hashlib.sha256(self.content_json().encode()).hexdigest()[:16]


def _resolve(base_dir: Path, source: SourceSpec) -> list[Path | str]:
    found: list[Path | str] = []
    for pattern in source.paths:
        found.extend(_match(base_dir, pattern, source.format, source.storage_options))
    # Local paths sort as paths (as they always did: plans stay byte-identical), object URLs after them.
    return sorted(set(found), key=lambda p: (0, p, "") if isinstance(p, Path) else (1, Path(), p))


def _match(
    base_dir: Path, pattern: str, fmt: SourceFormat, options: Mapping[str, Mapping[str, Any]] | None = None
) -> list[Path | str]:
    from loomdata.storage import _url  # a leaf module (no loomdata imports): URLs are told apart here

    if _url.is_url(pattern):
        from loomdata.storage import _fs  # lazy: fsspec is only needed for URL patterns

        return _match_objects(pattern, fmt, options or {}, _fs.glob)
    if pattern.startswith("file://"):
        pattern = pattern[len("file://") :]
    return list(_match_local(base_dir, pattern, fmt))


def _match_objects(pattern: str, fmt: SourceFormat, options: Mapping[str, Any], glob_fn: Any) -> list[Path | str]:
    """Object URLs a URL pattern matches (Megatron: prefixes whose .idx and .bin both exist)."""
    if fmt is SourceFormat.MEGATRON:
        stem = pattern[:-4] if pattern.endswith((".idx", ".bin")) else pattern
        idx = glob_fn(stem + ".idx", options)
        bins = set(glob_fn(stem + ".bin", options))
        return [u[:-4] for u in idx if u[:-4] + ".bin" in bins]
    return list(glob_fn(pattern, options))


def _match_local(base_dir: Path, pattern: str, fmt: SourceFormat) -> list[Path]:
    full = Path(pattern) if Path(pattern).is_absolute() else base_dir / pattern
    if fmt is SourceFormat.MEGATRON:
        # A Megatron path is a prefix: PREFIX.idx and PREFIX.bin; globs match the .idx files.
        stem = str(full)
        if stem.endswith((".idx", ".bin")):
            stem = stem[:-4]
        return [Path(p[:-4]) for p in glob.glob(stem + ".idx") if Path(p[:-4] + ".bin").exists()]
    return [Path(p) for p in glob.glob(str(full), recursive=True) if Path(p).is_file()]


def _key_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _metadata_problems(key: str, source: SourceSpec) -> list[str]:
    """Problems of a source's `metadata` list: index-column clashes, repeats, what its format can carry."""
    problems: list[str] = []
    index_columns = INDEX_COLUMNS
    seen: set[str] = set()
    for j, m in enumerate(source.metadata):
        mkey = f"{key}.metadata[{j}]"
        if not m.strip():
            problems.append(f"{mkey}: empty column name; give the field's name or drop the entry")
        elif m in index_columns:
            problems.append(
                f"{mkey}: {m!r} clashes with an index column ({', '.join(index_columns)}); "
                "rename it in the files or drop it from `metadata`"
            )
        elif (why := metadata_problem(source.format.value, m)) is not None:
            problems.append(f"{mkey}: {why}")
        if m in seen:
            problems.append(f"{mkey}: {m!r} is listed twice; list each column once")
        seen.add(m)
    return problems


def _semantic_problems(spec: Spec, check_paths: bool) -> list[str]:
    problems: list[str] = []
    names = spec.source_names
    seen: set[str] = set()
    for i, s in enumerate(spec.sources):
        key = f"sources[{i}]"
        if s.name in seen:
            problems.append(f"{key}.name: duplicate source name {s.name!r}")
        seen.add(s.name)
        problems.extend(field_problems(s, key))
        problems.extend(_metadata_problems(key, s))
        if check_paths:
            for j, pattern in enumerate(s.paths):
                if not _match(spec.base_dir, pattern, s.format, s.storage_options):
                    what = "no .idx/.bin pair matches" if s.format is SourceFormat.MEGATRON else "no file matches"
                    problems.append(f"{key}.paths[{j}]: {what} {pattern!r} (relative to {spec.base_dir})")
    if spec.tokenizer.kind is TokenizerKind.HUGGINGFACE:
        if spec.tokenizer.path is None:
            problems.append("tokenizer.path: required for kind huggingface (a tokenizer.json)")
        elif check_paths and not spec.tokenizer.path.is_file():
            problems.append(f"tokenizer.path: no file {str(spec.tokenizer.path)!r}")

    mix = spec.mixture
    if (mix.weights is None) == (mix.schedule is None):
        problems.append("mixture: give exactly one of `weights` or `schedule`")
    else:
        prefix = "mixture.weights" if mix.weights is not None else "mixture.schedule"
        ms = mix.milestones()
        if mix.schedule is not None and not ms:
            problems.append("mixture.schedule: needs at least one milestone")
        for k, m in enumerate(ms):
            mkey = prefix if mix.weights is not None else f"{prefix}[{k}]"
            wkey = mkey if mix.weights is not None else f"{mkey}.weights"
            for src, w in sorted(m.weights.items()):
                if src not in names:
                    problems.append(f"{wkey}.{src}: unknown source {src!r} (known: {', '.join(names)})")
                if not w >= 0 or w != w or w == float("inf"):
                    problems.append(f"{wkey}.{src}: weight must be a finite number >= 0, got {w}")
            if m.weights and all(w == 0 for w in m.weights.values()):
                problems.append(f"{wkey}: all weights are zero; at least one source needs a positive weight")
            if not m.weights:
                problems.append(f"{wkey}: no weights given")
            if k > 0 and m.step <= ms[k - 1].step:
                problems.append(f"{mkey}.step: steps must increase ({ms[k - 1].step} then {m.step})")
            if m.step >= spec.training.steps and mix.schedule is not None and k > 0:
                problems.append(
                    f"{mkey}.step: {m.step} is beyond training.steps ({spec.training.steps}); "
                    "drop the milestone or raise training.steps"
                )
    lc = spec.long_context
    if lc is not None:
        if lc.seq_len <= spec.training.seq_len:
            problems.append(
                f"long_context.seq_len: {lc.seq_len} must exceed training.seq_len ({spec.training.seq_len})"
            )
        if lc.threshold > lc.seq_len:
            problems.append(f"long_context.threshold: {lc.threshold} exceeds long_context.seq_len ({lc.seq_len})")
        if lc.seq_len % lc.cp_size:
            problems.append(f"long_context.seq_len: {lc.seq_len} is not divisible by cp_size ({lc.cp_size})")
    return problems


def _with_options(source: Any, shared: Mapping[str, Any]) -> Any:
    """A source mapping with the top-level `storage_options` under its own (its own win per protocol key)."""
    if not isinstance(source, Mapping):
        return source
    own = source.get("storage_options") or {}
    if not isinstance(own, Mapping):
        return source  # the model's validation reports it
    merged = {p: {**dict(shared.get(p) or {}), **dict(own.get(p) or {})} for p in {*shared, *own}}
    return {**source, "storage_options": merged}


def parse_spec(data: Mapping[str, Any], base_dir: Path, *, check_paths: bool = True, origin: str | None = None) -> Spec:
    """Validate a spec mapping; relative paths resolve against `base_dir`. Raises one SpecError."""
    if not isinstance(data, Mapping):
        raise SpecError([f"<root>: expected a mapping of keys, got {type(data).__name__}"], origin)
    raw = dict(data)
    base_dir = base_dir.resolve()
    raw["base_dir"] = base_dir
    if "workdir" in raw and isinstance(raw["workdir"], str) and not Path(raw["workdir"]).is_absolute():
        raw["workdir"] = str((base_dir / raw["workdir"]).resolve())
    shared = raw.pop("storage_options", None)  # top-level options: every source's, under its own per protocol
    if isinstance(shared, Mapping) and isinstance(raw.get("sources"), list):
        raw["sources"] = [_with_options(src, shared) for src in raw["sources"]]
    elif shared is not None:
        raise SpecError(["storage_options: expected a mapping of protocol -> options"], origin)
    tok = raw.get("tokenizer")
    if isinstance(tok, Mapping) and isinstance(tok.get("path"), str) and not Path(tok["path"]).is_absolute():
        raw["tokenizer"] = {**tok, "path": str((base_dir / tok["path"]).resolve())}
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as e:
        problems = [f"{_key_path(err['loc'])}: {err['msg']}" for err in e.errors()]
        raise SpecError(problems, origin) from None
    problems = _semantic_problems(spec, check_paths)
    if problems:
        raise SpecError(problems, origin)
    return spec


def _duplicate_keys(node: yaml.Node | None, path: str = "") -> list[str]:
    """Every mapping key given twice in the YAML node tree, by key path (YAML itself keeps the last one)."""
    out: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            where = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen:
                out.append(f"{where}: given twice (lines {seen[key]} and {line}); keep one")
            seen.setdefault(key, line)
            out.extend(_duplicate_keys(value_node, where))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.extend(_duplicate_keys(item, f"{path}[{i}]"))
    return out


def load_spec(path: str | Path, *, check_paths: bool = True) -> Spec:
    """Read and validate a YAML spec file. `check_paths=False` skips the file-existence checks."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError([f"<file>: cannot read spec: {e.strerror}"], str(p)) from None
    try:
        duplicates = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError([f"<yaml>: not valid YAML: {e}"], str(p)) from None
    if duplicates:
        raise SpecError(duplicates, str(p))
    return parse_spec(data, p.parent, check_paths=check_paths, origin=str(p))

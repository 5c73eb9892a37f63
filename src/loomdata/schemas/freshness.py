"""Whether an index and a plan still fit what is on disk: the one staleness rule, applied by every stage.

Two checks, both here and nowhere else:
- `require_fresh`: a plan records each source's index fingerprint (a content hash, see
  indexing/_fingerprint); serving, loading and re-planning compare it with the index there now.
- `require_built_from`: an index records the scan settings it was built with (`scan_settings`: format,
  fields, metadata, on_error, the tokenizer's kind and a hash of its tokenizer.json, the image rule,
  the resolved shard list of the globs) in samples.parquet's metadata; `loom plan` and `loom serve`
  refuse, listing every difference, when the spec's settings or the current glob expansion differ.
  (Older indexes fail on their table version; an index table written by hand records nothing and is
  not compared.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loomdata.schemas.errors import StaleIndexError
from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan_view import check_fresh
from loomdata.schemas.records import SourceFormat, TokenizerKind
from loomdata.schemas.tables import table_metadata

if TYPE_CHECKING:  # annotations only: a serving worker checks freshness without the pydantic spec
    from loomdata.schemas.plan import AnyPlan
    from loomdata.schemas.spec import SourceSpec, Spec

__all__ = [
    "SETTINGS_KEY",
    "current_fingerprints",
    "file_sha256",
    "index_differences",
    "require_built_from",
    "require_fresh",
    "scan_config",
    "scan_settings",
]

SETTINGS_KEY = "settings"
"""Key (under `loomdata.`) of the scan settings JSON in samples.parquet's metadata."""
_SETTINGS_VERSION = 1


def current_fingerprints(workdir: Path, sources: Sequence[str]) -> dict[str, str]:
    """The index fingerprint of each source as it is on disk under `workdir` now."""
    return {s: IndexFiles.of(workdir, s).fingerprint() for s in sources}


def require_fresh(meta: AnyPlan, workdir: Path, sources: Sequence[str] | None = None) -> None:
    """Raise StaleIndexError (listing every changed source) unless `sources` (default all) are as planned."""
    names = list(meta.sources if sources is None else sources)
    check_fresh(meta, current_fingerprints(workdir, names), names)


def file_sha256(path: Path) -> str:
    """sha256 of a whole (small) file such as tokenizer.json; "missing" when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    except OSError:
        return "missing"  # the spec check reports a missing tokenizer; the value only has to differ


def scan_config(spec: Spec, source: SourceSpec) -> dict[str, Any]:
    """Every spec setting that changes `source`'s scan output (no path): what the scan cache and the index hash."""
    config: dict[str, Any] = {
        "format": source.format.value,
        "tokens_field": source.tokens_field,
        "text_field": source.text_field,
        "image_field": list(source.image_field),
        "metadata": list(source.metadata),
        "on_error": source.on_error.value,
    }
    if source.text_field is not None:  # only raw text is tokenized during the scan
        tok = spec.tokenizer
        config["tokenizer"] = tok.kind.value
        if tok.kind is TokenizerKind.HUGGINGFACE and tok.path is not None:
            config["tokenizer_sha256"] = file_sha256(tok.path)
    if source.format is SourceFormat.WEBDATASET:
        config["images"] = spec.images.model_dump(mode="json")
    return config


def scan_settings(spec: Spec, source: SourceSpec) -> dict[str, Any]:
    """What `source`'s index is built from: its scan config, and its shard list and glob matches now."""
    return {
        "version": _SETTINGS_VERSION,
        **scan_config(spec, source),
        "shards": [str(p) for p in spec.resolve_paths(source)],
        "matches": {p: len(spec.resolve_paths(source.model_copy(update={"paths": [p]}))) for p in source.paths},
    }


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _differences(spec: Spec, source: SourceSpec, recorded: dict[str, Any]) -> list[str]:
    now = scan_settings(spec, source)
    out: list[str] = []
    for key in sorted((set(now) | set(recorded)) - {"shards", "matches", "version"}):
        if now.get(key) != recorded.get(key):
            out.append(f"{key}: indexed with {_show(recorded.get(key))}, the spec now says {_show(now.get(key))}")
    before, after = set(recorded.get("shards", [])), set(now["shards"])
    added, gone = sorted(after - before), sorted(before - after)
    if added:
        out.append(f"{len(added)} shard(s) the globs match now were not indexed: {', '.join(added[:5])}")
    if gone:
        out.append(f"{len(gone)} indexed shard(s) the globs no longer match: {', '.join(gone[:5])}")
    matched = recorded.get("matches", {})
    for pattern, n in now["matches"].items():
        if n == 0 and matched.get(pattern, 0) > 0:
            out.append(f"path {pattern!r} matches nothing now (it matched {matched[pattern]} at indexing)")
    return out


def index_differences(spec: Spec, sources: Sequence[str] | None = None) -> dict[str, list[str]]:
    """Per source (default all of the spec's), how the spec and glob expansion differ from its index's record."""
    out: dict[str, list[str]] = {}
    for name in spec.source_names if sources is None else sources:
        files = IndexFiles.of(spec.workdir, name)
        if not files.samples.exists():
            continue  # the readers that follow say `run loom index` for a missing index
        raw = table_metadata(files.samples).get(SETTINGS_KEY)
        if raw is None:  # a hand-made index table (tests, tools): nothing recorded to compare with
            continue
        diffs = _differences(spec, spec.source(name), json.loads(raw))
        if diffs:
            out[name] = diffs
    return out


def require_built_from(spec: Spec, sources: Sequence[str] | None = None) -> None:
    """Raise StaleIndexError, listing every difference, unless each source's index fits the spec and the files now."""
    diffs = index_differences(spec, sources)
    if diffs:
        lines = "\n".join(f"  - source {s!r}: {d}" for s, ds in diffs.items() for d in ds)
        raise StaleIndexError(
            f"the index under {spec.workdir / 'index'} was built from other settings or files than the spec "
            f"names now:\n{lines}\nre-run `loom index` (then `loom plan`)"
        )

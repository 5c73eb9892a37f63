"""Storage options per source for serving: taken at the edge, carried in memory to each Source Loader.

plan.json never holds a source's `storage_options` (SourceSpec leaves them out of every dump: no secret is
ever written to a file), so the spec a loader rebuilds from the plan has none. Serving takes them from the
caller instead: `loom serve PLAN_DIR --spec SPEC.yaml`, `serve(..., spec=...)` / `Executor(..., spec=...)`
(the spec the plan was made from, checked by its content hash without locations: `spec_options`) or
`storage_options={source: {protocol: {...}}}` (`mapping_options`). The executor hands each loader only its
own source's options, as an argument of the actor's creation (over the cluster's comm, TLS by default), so a
loader recreated after a worker loss or by a resize gets them too.

`SourceOptions` shows no secret: its repr and str are `redact`ed (a failed task's arguments, which Dask
logs, an error message or a debug print show `***`); it pickles by value, for the actor's creation only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

from loomdata.schemas.errors import ContractError
from loomdata.schemas.records import SourceRecord
from loomdata.storage import redact

if TYPE_CHECKING:  # annotations only: a loader unpickles SourceOptions in a worker, which imports no pydantic
    from loomdata.schemas.plan import PlanMeta
    from loomdata.schemas.spec import SourceSpec, Spec

__all__ = ["OptionsBySource", "SourceOptions", "mapping_options", "serving_options", "spec_options"]

OptionsBySource = Mapping[str, Mapping[str, Mapping[str, Any]]]
"""source name -> protocol -> fsspec keyword arguments (a SourceSpec's `storage_options`, per source)."""


@final
class SourceOptions:
    """The `storage_options` of each source of a plan, in memory only; repr and str show them redacted."""

    __slots__ = ("_by_source",)

    def __init__(self, by_source: OptionsBySource | None = None) -> None:
        self._by_source: dict[str, dict[str, dict[str, Any]]] = {
            name: {proto: dict(kw) for proto, kw in opts.items()} for name, opts in (by_source or {}).items() if opts
        }

    def of(self, source: str) -> dict[str, dict[str, Any]]:
        """A copy of `source`'s options (empty when none were given)."""
        return {proto: dict(kw) for proto, kw in self._by_source.get(source, {}).items()}

    def only(self, source: str) -> SourceOptions:
        """These options restricted to `source`: what one of its loaders is given, and nothing of another source."""
        return SourceOptions({source: self._by_source[source]} if source in self._by_source else None)

    def source_spec(self, source: SourceSpec) -> SourceSpec:
        """`source` with its options (a plan's SourceSpec has none); itself when none were given."""
        if source.name not in self._by_source:
            return source
        return source.model_copy(update={"storage_options": self.of(source.name)})

    def source_record(self, source: SourceRecord) -> SourceRecord:
        """`source_spec` of a plain record (what a loader reads its source as: no pydantic in a worker)."""
        if source.name not in self._by_source:
            return source
        return dataclasses.replace(source, storage_options=self.of(source.name))

    def apply(self, spec: Spec) -> Spec:
        """`spec` with every source's options (for the serving checks that list objects, e.g. the globs)."""
        if not self._by_source:
            return spec
        return spec.model_copy(update={"sources": [self.source_spec(s) for s in spec.sources]})

    @property
    def sources(self) -> list[str]:
        """Names of the sources that have options."""
        return sorted(self._by_source)

    def __bool__(self) -> bool:
        return bool(self._by_source)

    def __repr__(self) -> str:
        return f"SourceOptions({redact(self._by_source)!r})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[type[SourceOptions], tuple[dict[str, dict[str, dict[str, Any]]]]]:
        """Pickle by value: to a loader's worker, with its creation (never to a file)."""
        return (SourceOptions, (self._by_source,))


def spec_options(meta: PlanMeta, spec: Spec, *, origin: str | None = None, plan_dir: Any = None) -> SourceOptions:
    """The storage options of `spec`, once it is checked to be the spec `meta`'s plan was made from.

    The check compares content hashes without location fields (`Spec.content_hash`: no workdir, base_dir,
    tokenizer path, `verify` or storage options), so the spec file read from anywhere matches its plan.
    Raises ContractError naming both (the spec's origin and hash, the plan's id, plan.json and its hash).
    """
    given, planned = spec.content_hash(), meta.spec.content_hash()
    if given != planned:
        where = f"{plan_dir}/plan.json" if plan_dir is not None else "plan.json"
        name = origin or f"spec {spec.name!r}"
        raise ContractError(
            f"{name} is not the spec plan {meta.plan_id} was made from: its content hash (without locations) is "
            f"{given}, {where} says {planned} (spec {meta.spec.name!r}); serve with the spec file `loom plan` was "
            f"given, or re-plan with this one"
        )
    return SourceOptions({s.name: s.storage_options for s in spec.sources})


def mapping_options(meta: PlanMeta, storage_options: OptionsBySource) -> SourceOptions:
    """`storage_options` (source name -> protocol -> options) checked against the plan's sources.

    Raises ValueError naming unknown sources or malformed entries (never a value).
    """
    if not isinstance(storage_options, Mapping):
        raise ValueError(
            f"storage_options must map source names to {{protocol: options}}, got {type(storage_options).__name__}"
        )
    unknown = sorted(str(k) for k in storage_options if k not in meta.sources)
    if unknown:
        raise ValueError(
            f"storage_options name sources plan {meta.plan_id} does not have: {unknown}; it has {meta.sources}"
        )
    for name, opts in storage_options.items():
        if not isinstance(opts, Mapping) or not all(isinstance(kw, Mapping) for kw in opts.values()):
            raise ValueError(f"storage_options[{name!r}]: expected a mapping of protocol -> options")
    return SourceOptions(storage_options)


def serving_options(
    meta: PlanMeta,
    *,
    spec: Spec | str | Path | None = None,
    storage_options: SourceOptions | OptionsBySource | None = None,
    plan_dir: Any = None,
) -> SourceOptions:
    """The options a plan is served with: of `spec` (a Spec or a spec file, checked to be the plan's: see
    `spec_options`), or `storage_options` (source name -> protocol -> options), or none. Not both."""
    if spec is not None and storage_options is not None:
        raise ValueError("give the spec or storage_options, not both")
    if isinstance(spec, (str, Path)):
        from loomdata.schemas.spec import load_spec  # the serving process only

        return spec_options(meta, load_spec(spec, check_paths=False), origin=f"spec {spec}", plan_dir=plan_dir)
    if spec is not None:
        return spec_options(meta, spec, plan_dir=plan_dir)
    if isinstance(storage_options, SourceOptions):
        return mapping_options(meta, storage_options._by_source)
    return mapping_options(meta, storage_options or {})

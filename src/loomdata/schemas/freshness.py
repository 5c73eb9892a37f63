"""Whether a plan's index is still the index on disk: the one staleness rule, applied by every stage.

A plan records each source's index fingerprint (a content hash, see indexing/_fingerprint); serving,
loading and re-planning compare it with the fingerprint of the index there now, here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loomdata.schemas.layout import IndexFiles
from loomdata.schemas.plan import PlanMeta, check_fresh

__all__ = ["current_fingerprints", "require_fresh"]


def current_fingerprints(workdir: Path, sources: Sequence[str]) -> dict[str, str]:
    """The index fingerprint of each source as it is on disk under `workdir` now."""
    return {s: IndexFiles.of(workdir, s).fingerprint() for s in sources}


def require_fresh(meta: PlanMeta, workdir: Path, sources: Sequence[str] | None = None) -> None:
    """Raise StaleIndexError (listing every changed source) unless `sources` (default all) are as planned."""
    names = list(meta.sources if sources is None else sources)
    check_fresh(meta, current_fingerprints(workdir, names), names)

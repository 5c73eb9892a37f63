"""One parsed plan.json per process and plan: the hundreds of loaders of one worker share it.

A plan holds the whole spec (every source of the mixture: ~0.8 MiB for 300 sources as a `PlanMeta`), so a copy
per Source Loader grew a worker by sources x sources. Workers read it as a `PlanView` (plain records: no pydantic
in a worker; the serving process validated the file before creating any actor). It is frozen; the cache is keyed
by the file's identity (inode, size, mtime), so a rewritten plan.json is read again.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from loomdata.schemas.plan_view import PlanView, read_plan_view

__all__ = ["shared_plan"]

_KEEP = 4  # plans kept per process (a worker serves one plan at a time; a re-plan brings a second)
_CACHE: dict[tuple[str, int, int, int], PlanView] = {}
_LOCK = threading.Lock()


def shared_plan(plan_dir: str | Path) -> PlanView:
    """`read_plan_view(plan_dir)`, parsed once per process for as long as plan.json is unchanged."""
    p = Path(plan_dir).resolve()
    try:
        st = os.stat(p / "plan.json")
    except OSError:
        return read_plan_view(plan_dir)  # it raises the error that names the file
    key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns)
    with _LOCK:
        meta = _CACHE.get(key)
    if meta is None:
        meta = read_plan_view(plan_dir)
        with _LOCK:
            _CACHE[key] = meta
            while len(_CACHE) > _KEEP:
                del _CACHE[next(iter(_CACHE))]
    return meta

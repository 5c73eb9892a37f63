"""Where clients find a running executor: published Dask datasets and serve.json (see `protocol`).

`Publisher` remembers what it published, so `withdraw` removes exactly that (never the datasets of
another executor of the same plan) and serve.json only when it is still ours.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from distributed import Client

from loomdata.execution._outcome import best_effort
from loomdata.execution.protocol import ServeInfo, constructor_dataset, serve_dataset, serve_path, write_serve_info

__all__ = ["Publisher"]


class Publisher:
    """Publishes one plan's constructor handles and ServeInfo; withdraws them again."""

    def __init__(self, client: Client, plan_dir: Path, plan_id: str) -> None:
        self._client = client
        self._plan_dir = plan_dir
        self._plan_id = plan_id
        self._names: set[str] = set()
        self.info: ServeInfo | None = None

    def constructor(self, index: int, handle: Any) -> None:
        """Publish a constructor's handle under its deterministic name (clients re-resolve it after a loss)."""
        name = constructor_dataset(self._plan_id, index)
        self._client.publish_dataset(handle, name=name, override=True)
        self._names.add(name)

    def serve_info(self, info: ServeInfo) -> None:
        """Publish the ServeInfo on the scheduler and write it to serve.json."""
        name = serve_dataset(self._plan_id)
        self._client.publish_dataset(info.model_dump_json(), name=name, override=True)
        self._names.add(name)
        write_serve_info(self._plan_dir, info)
        self.info = info

    def withdraw(self) -> None:
        """Unpublish what this publisher published; remove serve.json if it still describes our executor."""
        for name in sorted(self._names):
            best_effort(f"unpublishing {name}", functools.partial(self._client.unpublish_dataset, name))
        self._names.clear()
        p = serve_path(self._plan_dir)
        if self.info is not None and _started_at(p) == self.info.started_at:
            p.unlink(missing_ok=True)
        self.info = None


def _started_at(path: Path) -> float | None:
    """`started_at` of the ServeInfo in `path`, None when absent or unreadable (another version wrote it)."""
    try:
        return ServeInfo.model_validate_json(path.read_text()).started_at
    except (OSError, ValueError):  # missing, or not our format (pydantic's ValidationError is a ValueError)
        return None

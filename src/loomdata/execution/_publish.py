"""Where clients find a running executor: published Dask datasets and serve.json (see `protocol`).

`Publisher` remembers what it published, so `withdraw` removes exactly that (never the datasets of
another executor of the same plan) and serve.json only when it is still ours (same pid and start).
While something is published, a daemon thread rewrites serve.json with a fresh `heartbeat_at`
every `Timings.heartbeat_s` (it touches only that file, never the fleet), so a client can tell a
dead executor from a slow one within seconds; it keeps beating while a long recovery step runs.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from distributed import Client

from loomdata.execution._outcome import best_effort
from loomdata.execution.protocol import (
    ServeInfo,
    TlsInfo,
    constructor_dataset,
    light_handle,
    serve_dataset,
    serve_path,
    write_serve_info,
)

__all__ = ["Publisher"]


class Publisher:
    """Publishes one plan's constructor handles and ServeInfo; withdraws them again."""

    def __init__(self, client: Client, plan_dir: Path, plan_id: str, *, heartbeat_s: float = 1.0) -> None:
        self._client = client
        self._plan_dir = plan_dir
        self._plan_id = plan_id
        self._names: set[str] = set()
        self.info: ServeInfo | None = None
        self._tls = _client_tls(client)
        self._file = threading.Lock()  # the heartbeat thread and the control loop both write serve.json
        self._stop = threading.Event()
        self._heartbeat_s = heartbeat_s
        self._beat: threading.Thread | None = None

    def constructor(self, index: int, handle: Any) -> None:
        """Publish a constructor's handle under its deterministic name (clients re-resolve it after a loss)."""
        name = constructor_dataset(self._plan_id, index)
        self._client.publish_dataset(light_handle(handle), name=name, override=True)  # ranks need not import it
        self._names.add(name)

    def serve_info(self, info: ServeInfo) -> None:
        """Publish the ServeInfo on the scheduler and write it to serve.json."""
        info = info.model_copy(update={"host": socket.gethostname(), "tls": self._tls, "heartbeat_at": time.time()})
        name = serve_dataset(self._plan_id)
        self._client.publish_dataset(info.model_dump_json(), name=name, override=True)
        self._names.add(name)
        with self._file:
            write_serve_info(self._plan_dir, info)
            self.info = info
        if self._beat is None:
            self._stop.clear()
            name = f"loom-heartbeat-{self._plan_id[:8]}"
            self._beat = threading.Thread(target=self._heartbeats, name=name, daemon=True)
            self._beat.start()

    def _heartbeats(self) -> None:
        """Refresh serve.json's heartbeat_at until withdrawn; stop if another executor took serve.json over."""
        while not self._stop.wait(self._heartbeat_s):
            with self._file:
                info = self.info
                if self._stop.is_set() or info is None:
                    return
                if _owner(serve_path(self._plan_dir)) not in (None, (info.pid, info.started_at)):
                    continue  # not ours any more: leave it alone
                info = info.model_copy(update={"heartbeat_at": time.time()})
                write = functools.partial(write_serve_info, self._plan_dir, info)
                best_effort("writing the serve.json heartbeat", write)
                self.info = info

    def withdraw(self) -> None:
        """Unpublish what this publisher published; remove serve.json if it still describes our executor."""
        self._stop.set()
        for name in sorted(self._names):
            best_effort(f"unpublishing {name}", functools.partial(self._client.unpublish_dataset, name))
        self._names.clear()
        p = serve_path(self._plan_dir)
        with self._file:
            if self.info is not None and _owner(p) == (self.info.pid, self.info.started_at):
                p.unlink(missing_ok=True)
            self.info = None
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=2 * self._heartbeat_s)
        self._beat = None


def _owner(path: Path) -> tuple[int, float] | None:
    """(pid, started_at) of the ServeInfo in `path`, None when absent or unreadable (another version wrote it)."""
    try:
        info = ServeInfo.model_validate_json(path.read_text())
    except (OSError, ValueError):  # missing, or not our format (RecordError is a ValueError)
        return None
    return info.pid, info.started_at


def _client_tls(client: Client) -> TlsInfo | None:
    """The credential files a client of this cluster uses (None: plain TCP, or credentials in memory)."""
    sec = getattr(client, "security", None)
    if sec is None or not str(client.scheduler.address if client.scheduler else "").startswith("tls://"):
        return None
    ca, cert, key = sec.tls_ca_file, sec.tls_client_cert, sec.tls_client_key
    if not (ca and cert and key) or any("\n" in str(v) for v in (ca, cert, key)):
        return None
    return TlsInfo(ca_file=os.path.abspath(ca), cert=os.path.abspath(cert), key=os.path.abspath(key))

"""`loom serve` in a process of its own (its own session, so a kill takes its workers too), for restart tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from loomdata.testing._processes import kill_session, session_processes


class Serving:
    """One `loom serve --json` process: its ServeInfo line, and ways to stop or kill it."""

    def __init__(self, plan_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "loomdata.cli", "serve", str(plan_dir), "--json", "--no-autoscale"]
        self._log = open(log, "a")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [*args, "--workers", "2", *extra],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"loom serve exited {self.proc.returncode}: {log.read_text()[-3000:]}")
        self.info: dict[str, Any] = json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def semaphores(self) -> set[Path]:
        """The named POSIX semaphores (/dev/shm/sem.*) the serve's processes have mapped and nobody has unlinked."""
        found: set[Path] = set()
        for p in session_processes(self.proc.pid):
            try:
                maps = Path(f"/proc/{p.pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/sem.") and not path[0].endswith(" (deleted)"):
                    found.add(Path(path[0]))
        return found

    def kill(self) -> None:
        """SIGKILL the serve and its worker processes (what an OOM killer or a lost node does)."""
        kill_session(self.proc)
        self.close()

    def stop(self) -> int:
        """SIGTERM: a clean stop; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.close()
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_session(self.proc)
        self._log.close()

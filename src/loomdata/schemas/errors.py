"""Exception classes, grouped by failure domain; every message says what is wrong and what to do."""

from __future__ import annotations

from collections.abc import Sequence


class LoomError(Exception):
    """Base of every error loomdata raises on purpose (the CLI prints these without a traceback)."""


class SpecError(LoomError):
    """An invalid data-plane spec; lists every problem at once, each with its key path."""

    def __init__(self, problems: Sequence[str], path: str | None = None) -> None:
        self.problems = list(problems)
        self.path = path
        self._args = (list(problems), path)
        where = f" in {path}" if path else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid data-plane spec{where} ({len(self.problems)} problem(s)):\n{lines}")

    def __reduce__(self) -> tuple[type[SpecError], tuple[list[str], str | None]]:
        """Pickle by constructor arguments."""
        return (SpecError, self._args)


class ContractError(LoomError):
    """A stored table or JSON file has the wrong format version or schema."""


class SourceDataError(LoomError):
    """A source file is unreadable, corrupt, truncated, or lacks a field; names the file and row."""

    def __init__(self, path: str, message: str, row: int | None = None, hint: str | None = None) -> None:
        self.path = path
        self.row = row
        self.reason = message
        self.hint = hint
        where = f"{path}" + (f", row {row}" if row is not None else "")
        fix = hint or "fix or remove the file, or set `on_error: skip` on the source to skip and count bad samples"
        super().__init__(f"{where}: {message} ({fix})")

    def __reduce__(self) -> tuple[type[SourceDataError], tuple[str, str, int | None, str | None]]:
        """Pickle by constructor arguments, so the error crosses process boundaries (Dask tasks, actors)."""
        return (SourceDataError, (self.path, self.reason, self.row, self.hint))


class IndexBuildError(LoomError):
    """The index job failed or its output is missing."""


class StaleIndexError(LoomError):
    """A plan was made on an index whose content has changed since; re-plan."""


class PlanError(LoomError):
    """The planner cannot satisfy the spec (empty source, epoch cap, budget no source can fill...)."""


class ExecutionError(LoomError):
    """The streaming executor failed (actor lost, loader error, serve.json missing...)."""

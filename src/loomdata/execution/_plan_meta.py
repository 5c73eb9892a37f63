"""One parsed plan.json per process and plan: the hundreds of loaders of one worker share it.

A plan holds the whole spec (every source of the mixture: ~0.8 MiB for 300 sources as a `PlanMeta`), so a copy
per Source Loader grew a worker by sources x sources. Workers read it as a `PlanView` (plain records: no pydantic
in a worker; the serving process validated the file before creating any actor). It is frozen; the cache is keyed
by the file's identity (inode, size, mtime), so a rewritten plan.json is read again.

The serving process reads it as a `PlanView` too, once a child interpreter validated it (`check_plan`).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomdata.execution._child import SAME_LOOMDATA, child_argv
from loomdata.execution._storage_options import OptionsBySource, SourceOptions
from loomdata.schemas.errors import ContractError, ExecutionError
from loomdata.schemas.plan_view import PlanView, read_plan_view

__all__ = ["CheckedPlan", "check_plan", "shared_plan"]

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


# ---- the serving process's plan check, in a child interpreter ------------------------------------------------------

PLAN_CHECK_TIMEOUT_S = 600.0
"""The most seconds the child interpreter that validates a plan for serving may take (it lists each source's files)."""

_ANSWER_MARK = b"\x00loom-plan-check\x00"
"""Ends the child's stdout, after its answer's pickle and that pickle's 8-byte length: anything printed before (a
sitecustomize, a .pth file) stays ahead of the answer, and the answer is found from the end."""

_CHECK = (
    """
import pickle
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # whatever else the child prints goes to stderr, never into the answer
"""
    + SAME_LOOMDATA
    + """
from loomdata.execution._plan_meta import _ANSWER_MARK, _check_in_child
answer = pickle.dumps(_check_in_child(sys.stdin.buffer.read()))
out.write(answer + len(answer).to_bytes(8, "little") + _ANSWER_MARK)
out.flush()
"""
)


@dataclass(frozen=True)
class CheckedPlan:
    """A plan validated for serving (`check_plan`): its `PlanView`, the storage options it is served with, and the
    model-parallel peers of a data-parallel rank its spec names (tp x pp x cp)."""

    plan_dir: Path
    view: PlanView
    options: SourceOptions
    peers: int


def check_plan(
    plan_dir: str | Path,
    *,
    spec: Any = None,
    storage_options: SourceOptions | OptionsBySource | None = None,
) -> CheckedPlan:
    """Validate plan.json (the pydantic `PlanMeta`), the spec or storage options it is served with (`serving_options`)
    and that each source's index was built from what the spec names now (`require_built_from`), in a short-lived
    child interpreter; then read the plan here as a `PlanView`.

    Why: pydantic and the spec and plan models cost the serving process ~9 MiB (PSS, benchmarks/memory.py) that it
    kept for its whole run to validate one file at start; the workers already read the plan as records. The child's
    error (ContractError, StaleIndexError, ValueError, ...) is raised here as it was raised there.
    """
    p = Path(plan_dir).resolve()
    request = pickle.dumps((str(p), spec, storage_options))
    try:
        done = subprocess.run(
            child_argv(_CHECK),
            input=request,
            capture_output=True,
            timeout=PLAN_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ExecutionError(
            f"checking the plan in {p} took more than {PLAN_CHECK_TIMEOUT_S:.0f} s in a child interpreter "
            f"({sys.executable})"
        ) from None
    except OSError as e:
        raise ExecutionError(f"could not start a Python interpreter ({sys.executable}) to check {p}: {e}") from None
    if done.stderr:  # the child's warnings and log lines belong in the serving log
        sys.stderr.write(done.stderr.decode(errors="replace"))
    try:
        kind, *got = pickle.loads(_answer_of(done.stdout))
    except Exception:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise ExecutionError(f"checking the plan in {p} failed in a child interpreter: {last}") from None
    if kind == "error":
        raise got[0]
    plan_id, options, peers = got
    view = read_plan_view(p)
    if view.plan_id != plan_id:
        raise ContractError(f"{p / 'plan.json'} changed while it was checked (plan {plan_id}, now {view.plan_id})")
    return CheckedPlan(p, view, options, peers)


def _answer_of(stdout: bytes) -> bytes:
    """The child's answer: the pickle before the 8-byte length and the `_ANSWER_MARK` that end stdout."""
    tail = len(_ANSWER_MARK) + 8
    if not stdout.endswith(_ANSWER_MARK) or len(stdout) < tail:
        raise ValueError("no answer")
    size = int.from_bytes(stdout[-tail : -len(_ANSWER_MARK)], "little")
    if size > len(stdout) - tail:
        raise ValueError("a truncated answer")
    return stdout[len(stdout) - tail - size : len(stdout) - tail]


def _check_in_child(request: bytes) -> tuple[Any, ...]:
    """`check_plan`'s work in the child: ("ok", plan id, options, peers) or ("error", the exception)."""
    from loomdata.execution._storage_options import serving_options
    from loomdata.schemas.freshness import require_built_from
    from loomdata.schemas.plan import read_plan

    plan_dir, spec, storage_options = pickle.loads(request)
    try:
        meta = read_plan(plan_dir)
        options = serving_options(meta, spec=spec, storage_options=storage_options, plan_dir=plan_dir)
        require_built_from(options.apply(meta.spec))  # nor the settings, nor what its globs match now
        t = meta.spec.training
        return ("ok", meta.plan_id, options, t.tp_size * t.pp_size * t.cp_size)
    except Exception as e:
        try:
            pickle.loads(pickle.dumps(e))  # some exceptions pickle but cannot be rebuilt from their args
        except Exception:
            return ("error", ExecutionError(f"{type(e).__name__}: {e}"))
        return ("error", e)

"""`pack_group`: a build group packed from each step's own answers (the tests' form of `pack_joined`, which serving
calls with answers for the steps' rows end to end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from loomdata.execution._manifest import ManifestRows
from loomdata.execution._pack_group import StepPack, pack_joined
from loomdata.execution._packing import PackRules


def join_answers(rows: Sequence[ManifestRows], answers: Sequence[Any]) -> tuple[list[np.ndarray], list[Any]]:
    """Each step's answers as answers for the steps' rows end to end (row indices shifted by the rows before)."""
    groups: list[np.ndarray] = []
    datas: list[Any] = []
    row_at = 0
    for step_rows, (sel, data) in zip(rows, answers, strict=True):
        groups.extend(row_at + np.asarray(g, dtype=np.int64) for g in sel)
        datas.extend(data)
        row_at += len(step_rows)
    return groups, datas


def pack_group(
    meta: Any, rules: PackRules, work: list[tuple[int, list[int]]], rows: Sequence[ManifestRows], answers: Sequence[Any]
) -> list[dict[int, StepPack]]:
    """`pack_joined` of the steps' rows end to end and their per-step answers joined."""
    bounds = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=bounds[1:])
    return pack_joined(meta, rules, work, ManifestRows.concat(rows), bounds, join_answers(rows, answers))

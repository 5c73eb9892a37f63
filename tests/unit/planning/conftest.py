"""Planner test helpers: synthetic index tables and specs (no data files needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from loomdata.schemas.spec import Spec, parse_spec
from loomdata.schemas.tables import synthetic_index


def index_table(lengths: Sequence[int] | np.ndarray, images: Sequence[int] | np.ndarray | None = None) -> pa.Table:
    """An index table (INDEX_SCHEMA columns) with the given token counts."""
    return synthetic_index(lengths, images)


def make_spec(
    workdir: Path,
    sources: Sequence[str],
    *,
    weights: dict[str, float] | None = None,
    schedule: list[dict[str, Any]] | None = None,
    seq_len: int = 128,
    steps: int = 10,
    dp: int = 4,
    micro_batches: int = 2,
    long_context: dict[str, int] | None = None,
    max_epochs: dict[str, float] | None = None,
    seed: int = 7,
    validate: bool = True,
) -> Spec:
    """A spec over parquet sources (paths unchecked) planning into `workdir`."""
    raw: dict[str, Any] = {
        "name": "t",
        "workdir": str(workdir),
        "seed": seed,
        "sources": [
            {
                "name": s,
                "format": "parquet",
                "paths": ["none/*.parquet"],
                "tokens_field": "ids",
                **({"max_epochs": max_epochs[s]} if max_epochs and s in max_epochs else {}),
            }
            for s in sources
        ],
        "mixture": {"schedule": schedule}
        if schedule is not None
        else {"weights": weights or dict.fromkeys(sources, 1.0)},
        "training": {"seq_len": seq_len, "steps": steps, "dp_size": dp, "micro_batches": micro_batches},
    }
    if long_context:
        raw["long_context"] = long_context
    if not validate:
        return Spec.model_validate({**raw, "base_dir": workdir})
    return parse_spec(raw, workdir, check_paths=False)


@pytest.fixture(scope="session")
def index_of() -> Callable[..., pa.Table]:
    return index_table


@pytest.fixture(scope="session")
def spec_of() -> Callable[..., Spec]:
    return make_spec

"""Helpers for the index-stage integration tests: build a spec over files a test wrote."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loomdata.schemas import Spec, parse_spec

SpecFactory = Callable[..., Spec]


@pytest.fixture
def make_spec(tmp_path: Path) -> SpecFactory:
    """`make_spec(source_dict, ..., tokenizer=None)`: a valid spec with workdir under tmp_path."""

    def make(*sources: dict[str, Any], tokenizer: dict[str, Any] | None = None, **extra: Any) -> Spec:
        data: dict[str, Any] = {
            "name": "t",
            "workdir": str(tmp_path / "work"),
            "sources": list(sources),
            "mixture": {"weights": {s["name"]: 1.0 for s in sources}},
            "training": {"seq_len": 128, "steps": 1, "dp_size": 1},
            **extra,
        }
        if tokenizer is not None:
            data["tokenizer"] = tokenizer
        return parse_spec(data, tmp_path)

    return make

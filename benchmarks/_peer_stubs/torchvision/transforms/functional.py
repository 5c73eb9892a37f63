"""Stub (see the package docstring)."""

from typing import Any


def to_tensor(pic: Any) -> Any:
    raise NotImplementedError("torchvision stub: not for images")

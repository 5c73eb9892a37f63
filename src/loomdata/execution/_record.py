"""Frozen JSON records validated without pydantic, for what a training rank reads (serve.json, serve.lock).

A rank imports `protocol` to find its constructor; with pydantic models there, every rank paid 4.7 MiB
of private memory for pydantic and pydantic-core (16 ranks: 76 MiB, more than the rest of the client;
`benchmarks/memory.py`). These records are keyword-only frozen dataclasses whose fields are checked
against their annotations (str, int, float, bool, `X | None`, `list[X]`, nested records) when built and
when read from JSON; unknown and missing keys are refused. The method names are pydantic's
(`model_validate`, `model_dump`, `model_copy`, ...), so code and tests that used the models read the same.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, ClassVar, TypeVar, get_args, get_origin

__all__ = ["Record", "RecordError"]

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A record's data does not match its fields (a ValueError, as pydantic's ValidationError is)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """Base of the protocol's records: validated on construction, to and from JSON-able dicts."""

    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check(value, _fields(type(self))[f.name], f"{type(self).__name__}.{f.name}")
            if checked is not value:
                object.__setattr__(self, f.name, checked)

    @classmethod
    def model_validate(cls: type[R], raw: Any) -> R:
        """A record from a dict (as JSON gives it): nested records built, unknown or missing keys refused."""
        return typing.cast(R, _build(cls, raw, cls.__name__))

    @classmethod
    def model_validate_json(cls: type[R], text: str | bytes) -> R:
        """A record from JSON text (RecordError, a ValueError, when it is not valid JSON or not this record)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecordError(f"{cls.__name__}: not valid JSON ({e})") from None
        return cls.model_validate(raw)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """The fields as a dict, nested records as dicts (`mode` is accepted for pydantic's signature)."""
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def model_dump_json(self) -> str:
        """Compact JSON of `model_dump`."""
        return json.dumps(self.model_dump(), separators=(",", ":"))

    def model_copy(self: R, *, update: dict[str, Any] | None = None) -> R:
        """A copy with `update`'s fields replaced (validated like a new record)."""
        return dataclasses.replace(self, **(update or {}))


def _fields(cls: type) -> dict[str, Any]:
    hints = Record._hints.get(cls)
    if hints is None:
        hints = Record._hints[cls] = {
            f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls) if f.init
        }
    return hints


def _build(cls: type, raw: Any, where: str) -> Record:
    if isinstance(raw, cls):
        return typing.cast(Record, raw)
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: expected an object, got {type(raw).__name__}")
    hints = _fields(cls)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise RecordError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    defaults = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    defaults |= {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}
    missing = sorted(set(hints) - set(raw) - defaults)
    if missing:
        raise RecordError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    try:
        return typing.cast(Record, cls(**{k: _check(v, hints[k], f"{where}.{k}") for k, v in raw.items()}))
    except TypeError as e:
        raise RecordError(f"{where}: {e}") from None


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as field type `hint` (nested dicts built into records, ints taken as floats), or RecordError."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _check(value, option, where)
            except RecordError as e:
                errors.append(str(e))
        raise RecordError("; ".join(errors))
    if origin is list:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(hint)
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(hint, type) and issubclass(hint, Record):
        return _build(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise RecordError(f"{where}: expected {hint.__name__}, got bool")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise RecordError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.model_dump()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value

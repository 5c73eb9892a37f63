"""`storage_options`: per-protocol keyword arguments for fsspec filesystems, and their redaction.

Options come from the spec (`storage_options: {s3: {endpoint_url: ...}}` on a source) and are never
written anywhere: the spec models exclude them from every dump, and `redact` hides secret values in
anything shown (errors, logs, reprs). plan.json therefore holds none: serving is given them at the edge
(`loom serve --spec`) and carries them in memory to each loader (`execution._storage_options`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "options_for", "redact"]

REDACTED = "***"
_SECRET_WORDS = ("secret", "password", "token", "key", "credential", "session", "auth", "signature")
_PUBLIC_KEYS = frozenset({"endpoint_url", "region_name", "anon", "use_ssl", "requester_pays", "project"})
_ALIASES = {"gcs": "gs", "http": "https"}


def _is_secret(name: str) -> bool:
    low = name.lower()
    return low not in _PUBLIC_KEYS and any(w in low for w in _SECRET_WORDS)


def redact(value: Any) -> Any:
    """A copy of `value` (nested mappings and lists) with every secret-looking key's value replaced by `***`."""
    if isinstance(value, Mapping):
        return {k: (REDACTED if _is_secret(str(k)) else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


def options_for(protocol: str, storage_options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """The options of `protocol` (`gcs` and `gs`, `http` and `https` share theirs)."""
    if not storage_options:
        return {}
    want = _ALIASES.get(protocol, protocol)
    out: dict[str, Any] = {}
    for name, opts in storage_options.items():
        if _ALIASES.get(name, name) == want:
            out.update(opts)
    return out

"""Frames of the rank gateway (`_gateway`, `client._direct`): requests as JSON, answers as out-of-band pickles.

Why a frame of its own: a rank that receives batches through a Dask client pays for a whole client
(~20 MiB of private memory per rank, a scheduler connection, an event-loop thread) and for Dask's
actor-call path on both ends; a rank only ever asks its constructor for steps. A frame is a fixed
header (magic, kind, request id, buffer count), the buffer lengths, a body and its buffers. A
request's body is JSON (method, arguments: plain numbers and lists, so the server never unpickles
what a client sent); an answer's body is a protocol-5 pickle whose NumPy arrays travel as raw
out-of-band buffers (no copy into the pickle; the receiver wraps them where they landed). Only a
client that authenticated the server (TLS against the cluster's CA) unpickles an answer.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ANSWER",
    "ERROR",
    "HEADER",
    "MAGIC",
    "REQUEST",
    "WireError",
    "decode_answer",
    "decode_request",
    "encode_answer",
    "encode_request",
    "lengths_format",
]

MAGIC = b"LOM1"
REQUEST, ANSWER, ERROR = 1, 2, 3
HEADER = struct.Struct("<4sBQI")  # magic, kind, request id, number of out-of-band buffers
MAX_BODY = 1 << 20  # a request body (JSON) is small; a larger one is not a loomdata client


class WireError(ConnectionError):
    """A frame that is not a loomdata gateway frame (wrong magic, kind or size): the peer is dropped."""


def lengths_format(n_buffers: int) -> struct.Struct:
    """The lengths after a header: the body's, then each buffer's (uint64)."""
    return struct.Struct(f"<{n_buffers + 1}Q")


def encode_request(request_id: int, target: str, method: str, args: list[Any], kwargs: dict[str, Any]) -> bytes:
    """One request frame (JSON body, no buffers) for `method` of the constructor published as `target`."""
    msg = {"target": target, "method": method, "args": args, "kwargs": kwargs}
    body = json.dumps(msg, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, REQUEST, request_id, 0) + lengths_format(0).pack(len(body)) + body


def decode_request(body: bytes) -> tuple[str, str, list[Any], dict[str, Any]]:
    """(target, method, args, kwargs) of a request body; WireError if it is not one."""
    try:
        msg = json.loads(body)
        target, method, args, kwargs = msg["target"], msg["method"], msg["args"], msg["kwargs"]
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"not a gateway request ({type(e).__name__}: {e})") from None
    if not (
        isinstance(target, str) and isinstance(method, str) and isinstance(args, list) and isinstance(kwargs, dict)
    ):
        raise WireError("not a gateway request (target, method, args, kwargs of the wrong types)")
    return target, method, args, kwargs


def encode_answer(request_id: int, value: Any, *, error: bool = False) -> list[bytes | memoryview]:
    """An answer frame's parts (header + lengths, body, buffers), to write in order without joining."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    head = HEADER.pack(MAGIC, ERROR if error else ANSWER, request_id, len(raws))
    lengths = lengths_format(len(raws)).pack(len(body), *(r.nbytes for r in raws))
    return [head + lengths, body, *raws]


def decode_answer(body: bytes | bytearray | memoryview, buffers: Sequence[bytearray | memoryview]) -> Any:
    """The value an answer carries (arrays backed by `buffers`, not copied)."""
    return pickle.loads(body, buffers=buffers)

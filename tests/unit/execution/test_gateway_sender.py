"""The gateway's same-host socket: answers far larger than the socket's buffer arrive whole and in order, a send
waiting for room on a connection that is closed under it fails instead of waiting forever, and the folders of
killed workers are swept."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from loomdata.execution._gateway import _Sender


def _parts() -> list[bytes | memoryview]:
    rng = np.random.default_rng(1)
    big = rng.integers(0, 255, 3 << 20, dtype=np.uint8)  # 3 MiB: many times a Unix socket's send buffer
    return [b"head", b"", memoryview(big), b"x" * 7, memoryview(big[: 1 << 20])[5:]]


def test_parts_arrive_whole_and_in_order_through_a_full_socket() -> None:
    parts = _parts()
    want = b"".join(bytes(p) for p in parts) * 3
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got = bytearray()

    def receive() -> None:
        while len(got) < len(want):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=receive)
    reader.start()

    async def main() -> None:
        a.setblocking(False)
        sender = _Sender(asyncio.get_running_loop(), a)
        for _ in range(3):
            await sender.send(parts)
        sender.close()

    asyncio.run(main())
    reader.join(timeout=60)
    b.close()
    assert bytes(got) == want


def test_a_send_waiting_for_room_fails_when_the_connection_closes() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # nobody reads b: the send fills the buffer

    async def main() -> None:
        a.setblocking(False)
        sender = _Sender(asyncio.get_running_loop(), a)
        send = asyncio.ensure_future(sender.send(_parts()))
        while not sender._waiting:  # until it waits for room
            await asyncio.sleep(0)
        sender.close()
        with pytest.raises(OSError):
            await send

    asyncio.run(main())
    b.close()

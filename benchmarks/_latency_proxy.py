"""A loopback TCP proxy that adds a fixed delay to every request, and counts requests and bytes.

For benchmarks/object_store.py: put it between S3 clients and a local S3-protocol server to stand in for
an object store's round-trip latency. Each chunk a client sends (an HTTP request, as S3 clients send
them) is held `delay_s` before it is forwarded; responses flow back undelayed. It listens on 127.0.0.1
only, runs in a daemon thread of the caller, and stops with `close()`.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass


@dataclass
class ProxyCounters:
    """What went through the proxy: requests (chunks starting with an HTTP method), bytes each way."""

    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


_METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


class LatencyProxy:
    """127.0.0.1:`port` -> `target_host`:`target_port`, every client chunk delayed by `delay_s`."""

    def __init__(self, target_port: int, delay_s: float, target_host: str = "127.0.0.1") -> None:
        self.delay_s = delay_s
        self.counters = ProxyCounters()
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="latency-proxy")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("latency proxy did not start within 10 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> ProxyCounters:
        """The counters so far; start new ones."""
        old, self.counters = self.counters, ProxyCounters()
        return old

    def close(self) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*self._target)
        except OSError:
            cw.close()
            return

        async def up() -> None:
            while data := await cr.read(1 << 16):
                if data.startswith(_METHODS):
                    self.counters.requests += 1
                    if self.delay_s > 0:
                        await asyncio.sleep(self.delay_s)
                self.counters.bytes_up += len(data)
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down() -> None:
            while data := await sr.read(1 << 16):
                self.counters.bytes_down += len(data)
                cw.write(data)
                await cw.drain()
            cw.close()

        try:
            await asyncio.gather(up(), down())
        except (ConnectionError, OSError):
            pass
        finally:
            for w in (sw, cw):
                w.close()

"""A take's CPU per MB on the worker and the rank, by the way its answer travels on one host.

The rank gateway (`execution/_gateway.py`) answers a rank's take with a frame (`execution/_wire.py`: header,
lengths, a protocol-5 pickle, its arrays as out-of-band buffers) over mutual TLS on TCP. This script serves
the same frames over several transports side by side in one run, from the real gateway (`_gateway._Gateway`
serving a stand-in constructor in a server process) to the real rank connection (`client._direct`):

- `tls`: TLS on TCP with the cluster's own TLS settings (`distributed.Security`, worker listen context; the rank
  uses `protocol.client_ssl_context`): a rank on another host;
- `tcp`: the same socket without TLS (`--insecure`; what TLS costs on its own);
- `uds`: the gateway's same-host Unix socket, same framing, no TLS: a rank on the worker's host;
- `shm` (not in loomdata; measured to decide): a Unix socket carrying header, lengths and pickle, the buffers
  written into a fresh memfd (`os.pwrite`) whose descriptor travels with the frame (SCM_RIGHTS); the rank maps
  it (MAP_POPULATE) and its arrays live in the mapping: the batch bytes are not copied through a socket.

Every answer's arrays are read once at the rank (a sum over their bytes: a training step reads its batch too, and
a mapping's pages are only faulted in when read); `touch_ms_per_mb` is that read alone on resident memory, so
`rank_ms_per_mb - touch` is the transport's own share. The worker's CPU is the server process's
(`time.process_time`, asked over the same connection). Rounds alternate the transports, so load from other
work hits each alike.

    .venv/bin/python benchmarks/gateway_transport.py --take-kib 48 768 3072 --takes 300 --rounds 3 \\
        --out benchmarks/results/gateway_transport.json

A benchmark tool: nothing in loomdata imports it.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import mmap
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from loomdata.client._direct import DirectConstructor, _Frame
from loomdata.execution._wire import (
    ANSWER,
    HEADER,
    MAGIC,
    REQUEST,
    decode_request,
    encode_answer,
    encode_request,
    lengths_format,
)

TRANSPORTS = ("tls", "tcp", "uds", "shm")
_ALIGN = 64


def _payload(nbytes: int) -> dict[str, Any]:
    """A take's answer of about `nbytes`: a block's arrays (tokens, labels, positions int32; small bounds, segments)."""
    n = max(1, nbytes // 12)
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(0, 50000, n, dtype=np.int32),
        "labels": rng.integers(0, 50000, n, dtype=np.int32),
        "position_ids": np.arange(n, dtype=np.int32) % 4096,
        "cu_seqlens": np.arange(0, n, 512, dtype=np.int32),
        "segments": np.zeros(max(1, n // 512), dtype=[("source", "<u2"), ("sample", "<u8"), ("offset", "<u4")]),
    }


# ---- the worker side ----------------------------------------------------------------------------


class _Target:
    """What the gateway serves as constructor "bench": a take's answer of the size asked, and its own CPU time."""

    def __init__(self) -> None:
        self.payloads: dict[int, dict[str, Any]] = {}

    def value(self, method: str, args: list[Any]) -> Any:
        if method == "record_telemetry":
            return time.process_time()
        nbytes = int(args[0])
        if nbytes not in self.payloads:
            self.payloads[nbytes] = _payload(nbytes)
        return self.payloads[nbytes]

    async def take_block(self, nbytes: int) -> Any:
        return self.value("take_block", [nbytes])

    async def record_telemetry(self) -> float:
        return time.process_time()

    async def serve_shm(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The memfd variant (not in loomdata): requests as the gateway reads them, answers by `_send_shm`."""
        raw = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))  # to send descriptors
        try:
            while True:
                try:
                    head = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    return
                magic, kind, request_id, _ = HEADER.unpack(head)
                assert magic == MAGIC and kind == REQUEST
                (length,) = lengths_format(0).unpack(await reader.readexactly(lengths_format(0).size))
                _, method, args, _ = decode_request(await reader.readexactly(length))
                parts = encode_answer(request_id, self.value(method, args))
                if method == "record_telemetry":
                    writer.writelines(parts)
                    await writer.drain()
                else:
                    await _send_shm(raw, parts)
        finally:
            raw.close()  # our duplicate of the descriptor
            writer.close()


async def _send_shm(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Header, lengths and pickle on the socket; the buffers in a fresh memfd (aligned), its descriptor beside them."""
    head, body, *raws = parts
    offsets, total = [], 0
    for r in raws:
        offsets.append(total)
        total += -(-memoryview(r).nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("loom-take", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(total, 1))
        for r, off in zip(raws, offsets, strict=True):
            os.pwrite(fd, r, off)
        message = bytes(head) + bytes(body)
        fds = array.array("i", [fd])
        sent = 0
        while sent < len(message):
            try:
                if sent == 0:
                    sent = sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                else:
                    sent += sock.send(message[sent:])
            except BlockingIOError:
                await asyncio.sleep(0.0005)
    finally:
        os.close(fd)


async def _serve_main(folder: Path) -> None:
    from loomdata.execution import _gateway
    from loomdata.execution._security import embedded_tls, security_of

    files = embedded_tls(folder / "tls")
    ctx = security_of(files).get_listen_args("worker")["ssl_context"]
    target = _Target()
    tls = await _gateway._GATEWAY.open("127.0.0.1", "tls", ctx)  # the worker's gateway: TLS and its Unix socket
    plain = _gateway._Gateway()
    tcp = await plain.open("127.0.0.1", "tcp", None)  # as with --insecure
    _gateway._GATEWAY.targets["bench"] = plain.targets["bench"] = target
    _TARGETS.append(target)
    shm = await asyncio.start_unix_server(target.serve_shm, str(folder / "shm.sock"))
    assert tls.local is not None
    hello = {"tls": tls.address, "tcp": tcp.address, "uds": tls.local.path, "ca": files.ca_file}
    print(json.dumps({**hello, "cert": files.cert, "key": files.key}), flush=True)
    await asyncio.Event().wait()
    del shm


_TARGETS: list[_Target] = []  # the gateway holds its targets weakly


# ---- the rank side ------------------------------------------------------------------------------


class _Conn:
    """One rank connection of a transport: `call(method, args)` answers as the rank's receiver would."""

    def __init__(self, kind: str, folder: Path, hello: dict[str, Any]) -> None:
        from loomdata.execution.protocol import TlsInfo, client_ssl_context

        self.kind = kind
        self.direct: DirectConstructor | None = None
        if kind == "shm":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(folder / "shm.sock"))
            self.frame = _Frame()
            self.ids = 0
            return
        tls = TlsInfo(ca_file=hello["ca"], cert=hello["cert"], key=hello["key"])
        ctx = client_ssl_context(hello["tls"], tls, plan_id="bench") if kind == "tls" else None
        address = hello["tcp"] if kind == "tcp" else hello["tls"]
        local = hello["uds"] if kind == "uds" else None
        self.direct = DirectConstructor(address, "bench", ctx, 30.0, local=local)  # the rank's own connection

    def call(self, method: str, args: list[Any]) -> Any:
        if self.direct is not None:
            if method == "cpu":
                return self.direct.record_telemetry().result(60)
            return self.direct.take_block(*args).result(60)
        self.ids += 1
        self.sock.sendall(
            encode_request(self.ids, "bench", "record_telemetry" if method == "cpu" else method, args, {})
        )
        if method != "cpu":
            return self._receive_shm()
        while True:
            done = self.frame.feed(self.sock, self.kind)
            if done is not None:
                return done[2]

    def _receive_shm(self) -> Any:
        sock = self.sock
        got = bytearray()
        fds: list[int] = []
        need = HEADER.size
        while len(got) < need:
            msg, more, _, _ = socket.recv_fds(sock, need - len(got), 4)
            if not msg:
                raise ConnectionError("closed")
            got += msg
            fds += more
            if len(got) >= HEADER.size and need == HEADER.size:
                magic, kind, _, n_buffers = HEADER.unpack_from(got)
                assert magic == MAGIC and kind == ANSWER
                fmt = lengths_format(n_buffers)
                need = HEADER.size + fmt.size
                while len(got) < need:
                    got += sock.recv(need - len(got))
                lengths = fmt.unpack_from(got, HEADER.size)
                need += lengths[0]
        (fd,) = fds
        body = got[HEADER.size + lengths_format(len(lengths) - 1).size :]
        sizes = lengths[1:]
        total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        try:
            mm = mmap.mmap(fd, max(total, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        view, buffers, off = memoryview(mm), [], 0
        for n in sizes:
            buffers.append(view[off : off + n])
            off += -(-n // _ALIGN) * _ALIGN
        return pickle.loads(body, buffers=buffers)

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
        else:
            self.sock.close()


def _touch(value: dict[str, Any]) -> int:
    """Read every byte of the answer's arrays once (as a training step reads its batch)."""
    total = 0
    for a in value.values():
        b = np.frombuffer(a.data if a.flags.c_contiguous else a.tobytes(), dtype=np.uint8)
        total += int(b[: b.size // 8 * 8].view(np.uint64).sum(dtype=np.uint64) & 0xFF)
    return total


def _measure(conn: _Conn, nbytes: int, takes: int) -> dict[str, float]:
    for _ in range(5):  # warm: payload built, buffers grown
        _touch(conn.call("take", [nbytes]))
    moved = sum(a.nbytes for a in conn.call("take", [nbytes]).values())
    w0, r0, t0 = conn.call("cpu", []), time.process_time(), time.perf_counter()
    for _ in range(takes):
        _touch(conn.call("take", [nbytes]))
    w1, r1, t1 = conn.call("cpu", []), time.process_time(), time.perf_counter()
    mb = moved * takes / 1e6
    return {
        "worker_ms_per_mb": (w1 - w0) * 1e3 / mb,
        "rank_ms_per_mb": (r1 - r0) * 1e3 / mb,
        "wall_ms_per_mb": (t1 - t0) * 1e3 / mb,
        "take_bytes": moved,
    }


def _touch_baseline(nbytes: int, takes: int) -> float:
    value = _payload(nbytes)
    moved = sum(a.nbytes for a in value.values())
    _touch(value)
    r0 = time.process_time()
    for _ in range(takes):
        _touch(value)
    return (time.process_time() - r0) * 1e3 / (moved * takes / 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--take-kib", type=int, nargs="+", default=[768, 3072], help="answer sizes (KiB)")
    p.add_argument("--takes", type=int, default=300, help="takes measured per transport, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gateway_transport.json")
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        asyncio.run(_serve_main(args.serve))
        return
    with tempfile.TemporaryDirectory(prefix="loom-gwbench-") as tmp:
        folder = Path(tmp)
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(folder)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            hello = json.loads(server.stdout.readline())
            runs: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                for kib in args.take_kib:
                    for kind in args.transports:
                        conn = _Conn(kind, folder, hello)
                        try:
                            got = _measure(conn, kib * 1024, args.takes)
                        finally:
                            conn.close()
                        runs.append({"round": rnd, "take_kib": kib, "transport": kind, **got})
                        print(json.dumps(runs[-1]), flush=True)
            touch = {kib: _touch_baseline(kib * 1024, args.takes) for kib in args.take_kib}
        finally:
            server.kill()
            server.wait()
    summary: dict[str, Any] = {}
    for kib in args.take_kib:
        rows = {}
        for kind in args.transports:
            mine = [r for r in runs if r["take_kib"] == kib and r["transport"] == kind]
            rows[kind] = {
                k: round(statistics.median(r[k] for r in mine), 4)
                for k in ("worker_ms_per_mb", "rank_ms_per_mb", "wall_ms_per_mb")
            }
            rows[kind]["rank_transport_ms_per_mb"] = round(rows[kind]["rank_ms_per_mb"] - touch[kib], 4)
        base = rows.get("tls")
        if base is not None:
            for row in rows.values():
                for k in ("worker_ms_per_mb", "rank_ms_per_mb", "rank_transport_ms_per_mb"):
                    row[f"{k.removesuffix('_ms_per_mb')}_vs_tls"] = round(row[k] / base[k], 3) if base[k] else None
                row["take_cpu_vs_tls"] = round(
                    (row["worker_ms_per_mb"] + row["rank_ms_per_mb"])
                    / (base["worker_ms_per_mb"] + base["rank_ms_per_mb"]),
                    3,
                )
        summary[f"{kib}KiB"] = {"touch_ms_per_mb": round(touch[kib], 4), "medians": rows}
    out = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load": os.getloadavg(),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

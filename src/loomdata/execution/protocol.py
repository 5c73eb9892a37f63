"""The small request/response protocol between a running executor and its clients (`serve.json`).

A client needs three things: where the scheduler is, which Data Constructor serves its dp rank,
and how to get a handle to that actor. The executor publishes each constructor's actor handle as a
Dask dataset under a deterministic name (`constructor_dataset`) and writes `ServeInfo` both to
`PLAN_DIR/serve.json` and as the dataset `serve_dataset(plan_id)`, so a client given only a
scheduler address finds it too, and a client can reconnect to a restarted executor of the same plan.
A constructor recreated after its worker died is re-published under the same name (and ServeInfo
rewritten with its new worker), so a client re-resolves the name and asks again.

A constructor answers `take(dp_rank, step)` with that rank's micro-batches of that step
(`list[Batch]`, in micro-batch order): one actor call per rank and step. The request names the step,
so any constructor of the plan (a recreated one too) can rebuild it from the manifest; the position
inside the step (micro_batch) stays with the client. Both sides share the serving `Timings` (how
long a client retries, how often it checks its constructor) and the retry helper (`retry_until`).

Trust: serve.json names the TLS files a client uses (paths only). A client accepts them only when
they are owned by its own user and closed to others (`client_security`), and refuses a plain-TCP
scheduler unless told `insecure`, so a forged serve.json cannot point a rank at a foreign scheduler.
Liveness: serve.json carries the serving pid, host and a heartbeat time refreshed every second, and
`serve.lock` names the serve that holds the plan; `dead_server` tells a client that nobody serves.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomdata.execution._config import Timings
from loomdata.execution._record import Record, RecordError
from loomdata.execution._retry import Deadline, retry_until
from loomdata.schemas.errors import ContractError, ExecutionError

__all__ = [
    "SERVE_FORMAT_VERSION",
    "ConstructorCalls",
    "ConstructorInfo",
    "Deadline",
    "ExecutorUnavailable",
    "LoaderInfo",
    "LocalGateway",
    "ServeInfo",
    "ServeLock",
    "Timings",
    "TlsInfo",
    "client_security",
    "client_ssl_context",
    "constructor_dataset",
    "dead_server",
    "env_security",
    "env_tls",
    "host_id",
    "light_handle",
    "lock_path",
    "parse_serve_info",
    "peer_uid",
    "pid_alive",
    "read_lock",
    "read_serve_info",
    "retry_until",
    "serve_dataset",
    "serve_path",
    "write_serve_info",
]

SERVE_FORMAT_VERSION = 4
"""4: a constructor's gateway may name a same-host endpoint (`ConstructorInfo.local`); 3: gateway ids."""


class ExecutorUnavailable(ExecutionError):
    """The executor is stopping or not (yet) published; a client reconnects and retries."""


@dataclass(frozen=True, kw_only=True)
class LocalGateway(Record):
    """A gateway's same-host endpoint: a Unix-domain socket in a folder only its user can enter (mode 0700).

    `host_id` (`host_id()` on the worker) tells a rank whether it runs on the gateway's host; a rank elsewhere,
    or one that cannot connect, uses the TLS address. Filesystem permissions (and the peer's uid, checked on
    both ends) stand in for TLS's mutual authentication there (docs/security.md).
    """

    path: str
    host_id: str


@dataclass(frozen=True, kw_only=True)
class ConstructorInfo(Record):
    """One Data Constructor: its published dataset name, the dp ranks it serves, where ranks reach it.

    `gateway`: the address of its worker's rank gateway (`_gateway`), None where it has none (ranks
    then call it through Dask); `gateway_id`: the id that gateway drew when it opened, so a gateway
    restarted on the same address is a different one to a rank (`StreamClient` reconnects); `local`: the
    same gateway's endpoint for ranks on its host (None: TLS only).
    """

    name: str
    ranks: list[int]
    worker: str
    gateway: str | None = None
    gateway_id: str | None = None
    local: LocalGateway | None = None


@dataclass(frozen=True, kw_only=True)
class LoaderInfo(Record):
    """One Source Loader: the source, its shard range and sample range, and where it runs."""

    name: str
    source: str
    part: int
    first_shard: int
    stop_shard: int
    first_sample: int
    stop_sample: int
    worker: str


@dataclass(frozen=True, kw_only=True)
class TlsInfo(Record):
    """The PEM files a client presents and checks the scheduler against (paths, never key material)."""

    ca_file: str
    cert: str
    key: str


@dataclass(frozen=True, kw_only=True)
class ServeLock(Record):
    """Contents of serve.lock: which `loom serve` holds a plan dir."""

    pid: int
    host: str
    started_at: float


@dataclass(frozen=True, kw_only=True)
class ServeInfo(Record):
    """Contents of serve.json: how clients find a running executor of a plan."""

    format_version: int = SERVE_FORMAT_VERSION
    plan_id: str
    scheduler: str
    window: int
    peers: int
    constructors: list[ConstructorInfo]
    loaders: list[LoaderInfo]
    pid: int
    started_at: float
    host: str = ""
    heartbeat_at: float = 0.0  # refreshed about every second while the executor serves
    tls: TlsInfo | None = None  # None: a plain-TCP scheduler (`--insecure`) or in-memory credentials

    def constructor_for(self, dp_rank: int) -> ConstructorInfo:
        """The constructor serving `dp_rank` (ExecutionError when none does)."""
        for c in self.constructors:
            if dp_rank in c.ranks:
                return c
        served = sorted(r for c in self.constructors for r in c.ranks)
        raise ExecutionError(
            f"plan {self.plan_id}: no constructor serves dp rank {dp_rank} (served ranks: "
            f"{served[0] if served else '-'}..{served[-1] if served else '-'}); check the rank"
        )


def serve_path(plan_dir: str | Path) -> Path:
    """Where a running executor writes its ServeInfo."""
    return Path(plan_dir) / "serve.json"


def serve_dataset(plan_id: str) -> str:
    """Dask dataset name under which the executor publishes its ServeInfo (as a JSON string)."""
    return f"loomdata/{plan_id}/serve"


class ConstructorCalls:
    """The methods a Data Constructor answers, as a rank's actor handle names them (no implementation here).

    A Dask actor handle pickles its class by reference, so a handle to the real `DataConstructor` makes
    every rank that unpickles it import the constructor with Arrow, the planner's spec and the loaders
    (about 0.6 s and tens of MiB before the first batch). The executor publishes `light_handle`s instead:
    the same actor (key and worker), with this class, which a rank already has. Calls run the real methods
    on the worker; `tests/unit/execution/test_protocol.py` keeps the names in step with DataConstructor.
    """

    async def start(self) -> Any: ...
    async def take(self, *args: Any, **kwargs: Any) -> Any: ...
    async def take_steps(self, *args: Any, **kwargs: Any) -> Any: ...
    async def take_block(self, *args: Any, **kwargs: Any) -> Any: ...
    async def record_telemetry(self, *args: Any, **kwargs: Any) -> None: ...
    async def drain_telemetry(self) -> Any: ...
    async def set_routes(self, *args: Any, **kwargs: Any) -> None: ...
    async def open_gateway(self, *args: Any, **kwargs: Any) -> Any: ...
    async def metrics(self) -> Any: ...
    async def stop(self) -> None: ...


def light_handle(handle: Any) -> Any:
    """`handle` (an Actor of a DataConstructor) as an Actor of `ConstructorCalls`: same actor, cheap to unpickle."""
    from distributed.actor import Actor

    return Actor(ConstructorCalls, handle._address, handle.key)


def constructor_dataset(plan_id: str, index: int) -> str:
    """Dask dataset name under which constructor `index` of a plan's executor is published."""
    return f"loomdata/{plan_id}/constructor/{index}"


def write_serve_info(plan_dir: str | Path, info: ServeInfo) -> Path:
    """Write serve.json atomically (a reader never sees half a file)."""
    p = serve_path(plan_dir)
    tmp = p.with_name(f".serve.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info.model_dump(mode="json"), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p


def parse_serve_info(text: str, where: str) -> ServeInfo:
    """Validate ServeInfo JSON, rejecting an unknown format version with the fix."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(f"{where}: not valid JSON ({e})") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != SERVE_FORMAT_VERSION:
        raise ContractError(
            f"{where}: serve format version {version} is not supported (this loomdata reads version "
            f"{SERVE_FORMAT_VERSION}); restart `loom serve` with this version of loomdata"
        )
    try:
        return ServeInfo.model_validate(raw)
    except RecordError as e:
        raise ContractError(f"{where}: invalid serve info: {e}") from None


def read_serve_info(plan_dir: str | Path) -> ServeInfo:
    """Read serve.json; ExecutionError saying what to run when no executor serves the plan."""
    p = serve_path(plan_dir)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ExecutionError(
            f"{p}: no executor is serving this plan; start one with `loom serve {Path(plan_dir)}` "
            "or pass the scheduler address"
        ) from None
    return parse_serve_info(text, str(p))


def lock_path(plan_dir: str | Path) -> Path:
    """The lock a `loom serve` holds on its plan dir."""
    return Path(plan_dir) / "serve.lock"


def read_lock(plan_dir: str | Path) -> ServeLock | None:
    """The serve.lock of `plan_dir` (None when absent or unreadable)."""
    try:
        return ServeLock.model_validate_json(lock_path(plan_dir).read_text())
    except (OSError, ValueError):
        return None


def pid_alive(host: str, pid: int) -> bool | None:
    """Whether process `pid` runs: True/False on this host, None (unknown) for another host."""
    if host and host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def dead_server(plan_dir: str | Path, timings: Timings, *, now: float | None = None) -> str | None:
    """Why nobody serves `plan_dir` (an error message), or None while a serve runs or is starting.

    Dead: serve.json's heartbeat is older than `timings.dead_after_s` and its pid is gone (or on
    another host), and no other live `loom serve` holds serve.lock (a restart under way).
    """
    now = time.time() if now is None else now
    p = serve_path(plan_dir)
    try:
        info = ServeInfo.model_validate_json(p.read_text())
    except (OSError, ValueError):
        return None  # no serve.json (yet): `read_serve_info` says what to run
    alive = pid_alive(info.host, info.pid)
    if alive is True or now - info.heartbeat_at <= timings.dead_after_s:
        return None  # running, or gone less than dead_after_s ago: a restart may still take the lock
    lock = read_lock(plan_dir)
    if lock is not None and lock.pid != info.pid and pid_alive(lock.host, lock.pid) is not False:
        return None  # another serve holds the plan: it is starting up
    why = "is not running" if alive is False else "answers no more"
    why += f" (no heartbeat for {now - info.heartbeat_at:.1f}s)"
    return (
        f"{p}: the executor of plan dir {Path(plan_dir)} (pid {info.pid} on {info.host or 'this host'}) {why}; "
        f"restart it with `loom serve {Path(plan_dir)}`"
    )


def host_id() -> str:
    """This host as a rank and a gateway both see it: host name and kernel boot id (another host, or a reboot,
    differs; containers on one kernel with their own host names differ too, so they use TLS)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def foreign_folder(folder: Path) -> str | None:
    """Why `folder` is not a socket folder of this user closed to others (None: it is one); raises OSError if gone.

    What a same-host client checks before it trusts a Unix socket's answers (the rank gateway, the loader link)."""
    st = os.lstat(folder)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    return (
        f"{folder} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, not a folder of uid "
        f"{os.getuid()} closed to others"
    )


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED; None where unknown)."""
    try:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):
        return None
    return int(uid)


def env_tls() -> TlsInfo | None:
    """A client's own TLS files from LOOM_TLS_CA_FILE, LOOM_TLS_CERT and LOOM_TLS_KEY (None when unset)."""
    names = ("LOOM_TLS_CA_FILE", "LOOM_TLS_CERT", "LOOM_TLS_KEY")
    values = [os.environ.get(n) for n in names]
    if not any(values):
        return None
    if not all(values):
        got = [n for n, v in zip(names, values, strict=True) if v]
        raise ExecutionError(f"set all of {', '.join(names)} or none (got {', '.join(got)})")
    return TlsInfo(ca_file=str(values[0]), cert=str(values[1]), key=str(values[2]))


def env_security() -> Any:
    """A client Security from LOOM_TLS_CA_FILE, LOOM_TLS_CERT and LOOM_TLS_KEY (None when unset)."""
    tls = env_tls()
    return _security_of(tls) if tls is not None else None


def _security_of(tls: TlsInfo) -> Any:
    from distributed.security import Security

    return Security(require_encryption=True, tls_ca_file=tls.ca_file, tls_client_cert=tls.cert, tls_client_key=tls.key)


def client_ssl_context(
    address: str, tls: TlsInfo | None, *, plan_id: str, own: Any = None, insecure: bool = False
) -> ssl.SSLContext | None:
    """The TLS context a rank connects to a constructor's gateway with (None: plain TCP, only if `insecure`).

    The same rules as `client_security`: `own` (a `distributed.Security`, or the client's own files
    as a TlsInfo) wins; else the files serve.json names, checked to belong to this user. The server
    is verified against the cluster's CA and sees the client's certificate (mutual TLS, as Dask).
    """
    if not address.startswith("tls://"):
        if insecure:
            return None
        raise ExecutionError(
            f"plan {plan_id}: the gateway {address} speaks plain TCP; loomdata clients connect only with "
            "TLS. If that serve runs with --insecure on purpose, pass insecure=True (or set LOOM_INSECURE=1) "
            "in the client too"
        )
    if own is not None and not isinstance(own, TlsInfo):
        context: ssl.SSLContext = own.get_connection_args("client")["ssl_context"]
        return context
    files = own if isinstance(own, TlsInfo) else tls
    if files is None:
        raise ExecutionError(
            f"plan {plan_id}: the gateway {address} needs TLS credentials and serve.json names none; pass "
            "the client's own (LOOM_TLS_CA_FILE, LOOM_TLS_CERT, LOOM_TLS_KEY)"
        )
    if own is None:
        for what, path in (("CA file", files.ca_file), ("certificate", files.cert), ("key", files.key)):
            _check_private(what, Path(path), secret=what == "key")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files.ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert, files.key)
    ctx.check_hostname = False  # a cluster CA of its own, and IP addresses: as Dask's own comms
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_security(
    scheduler: str, tls: TlsInfo | None, *, plan_id: str, own: Any = None, insecure: bool = False
) -> Any:
    """The `distributed.Security` a client uses for `scheduler`, given the TLS files serve.json names.

    `own`: the client's own Security (or None: take the files serve.json names, after checking that
    they belong to this user and nobody else can write them, or read the key). A plain-TCP
    scheduler is refused unless `insecure`.
    """
    if not scheduler.startswith("tls://"):
        if insecure:
            return own
        raise ExecutionError(
            f"plan {plan_id}: the scheduler {scheduler} speaks plain TCP; loomdata clients connect only with "
            "TLS. If that serve runs with --insecure on purpose, pass insecure=True (or set LOOM_INSECURE=1) "
            "in the client too"
        )
    if isinstance(own, TlsInfo):
        return _security_of(own)
    if own is not None:
        return own
    if tls is None:
        raise ExecutionError(
            f"plan {plan_id}: the scheduler {scheduler} needs TLS credentials and serve.json names none; pass "
            "the client's own (LOOM_TLS_CA_FILE, LOOM_TLS_CERT, LOOM_TLS_KEY)"
        )
    for what, path in (("CA file", tls.ca_file), ("certificate", tls.cert), ("key", tls.key)):
        _check_private(what, Path(path), secret=what == "key")
    return _security_of(tls)


def _check_private(what: str, path: Path, *, secret: bool) -> None:
    """Refuse a credential file that another user owns or can write (or, for a key, read)."""
    try:
        st = path.stat()
    except OSError as e:
        raise ExecutionError(f"TLS {what} {path} named by serve.json: {e.strerror or e}") from None
    open_to = stat.S_IRWXG | stat.S_IRWXO if secret else stat.S_IWGRP | stat.S_IWOTH
    if st.st_uid != os.getuid() or st.st_mode & open_to:
        raise ExecutionError(
            f"TLS {what} {path} named by serve.json is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}; a client uses only credentials of its own user (uid {os.getuid()}) "
            f"that others cannot {'read or ' if secret else ''}write: this serve.json was not written by "
            "your `loom serve`"
        )

"""A served plan is reachable only with its credentials: TLS with mutual authentication, on by default.

One `loom serve` (embedded cluster, Dask's require-encryption set as a user might) serves a plan;
clients without credentials, with credentials of another CA, as another OS user, or led by a forged
serve.json to a foreign scheduler are all refused, while the real StreamClients stream exact batches.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loomdata.client import StreamClient
from loomdata.execution import open_cluster
from loomdata.execution._dask_client import new_client
from loomdata.execution._security import embedded_tls, security_of
from loomdata.execution.protocol import ServeInfo, read_serve_info, serve_path, write_serve_info
from loomdata.schemas import ExecutionError
from loomtest.stream import check_exact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from _serving import Serving


@pytest.fixture(scope="module")
def served(dask_client: Any, loomtest: Any) -> Iterator[tuple[Path, ServeInfo]]:
    """A plan in a world-readable folder, served by `loom serve` with DASK_..._REQUIRE_ENCRYPTION=True."""
    base = Path(tempfile.mkdtemp(prefix="loom-sec-"))
    base.chmod(0o755)  # others may read the plan; the credentials folder alone keeps them out
    try:
        spec = loomtest.make_spec(base, steps=4, dp_size=2)
        plan_dir = Path(loomtest.index_and_plan(spec, dask_client))
        env = {"DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
        serving = Serving(plan_dir, base / "serve.log", env=env)
        try:
            yield plan_dir, read_serve_info(plan_dir)
        finally:
            serving.stop()
            serving.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_real_clients_stream_exact_batches_over_tls(served: tuple[Path, ServeInfo]) -> None:
    plan_dir, info = served
    assert info.scheduler.startswith("tls://127.0.0.1:")
    assert info.tls is not None
    got = {}
    for r in (0, 1):
        with StreamClient(plan_dir, r, local_gateway=False) as s:  # TLS even on the gateway's host
            got[r] = list(s)
            assert s.transport == "tls"
    check_exact(plan_dir, got)


def test_credentials_are_private_to_the_owner(served: tuple[Path, ServeInfo]) -> None:
    _, info = served
    assert info.tls is not None
    folder = Path(info.tls.key).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for f in (info.tls.ca_file, info.tls.cert, info.tls.key):
        assert stat.S_IMODE(Path(f).stat().st_mode) == 0o600 and Path(f).stat().st_uid == os.getuid()
    assert "PRIVATE KEY" not in serve_path(served[0]).read_text()  # serve.json names paths only


def _connect_error(address: str, security: Any = None) -> BaseException | None:
    """The error connecting a Client raises (None when it connects); a slow IO-loop start is tried again.

    `new_client` collects a Client whose constructor raised at once (see `execution/_dask_client.py`).
    """
    for _ in range(3):
        try:
            new_client(address, timeout=5, security=security).close()
            return None
        except AssertionError:  # Dask's loop thread did not start within 10 s on a loaded machine
            continue
        except Exception as e:
            return e
    raise AssertionError("the Dask client's IO loop never started")


def test_a_client_without_credentials_is_refused(served: tuple[Path, ServeInfo]) -> None:
    _, info = served
    assert isinstance(_connect_error(info.scheduler), (OSError, TypeError, TimeoutError))
    assert isinstance(_connect_error(info.scheduler.replace("tls://", "tcp://")), (OSError, TimeoutError))


def test_credentials_of_another_ca_are_refused(served: tuple[Path, ServeInfo], tmp_path: Path) -> None:
    _, info = served
    other = security_of(embedded_tls(tmp_path / "other"))
    assert isinstance(_connect_error(info.scheduler, other), (OSError, TimeoutError))


def _python_for(uid: int) -> str | None:
    """An interpreter user `uid` may run (the venv's may sit in root's home): this one, else the system's."""
    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            ok = subprocess.run([exe, "-c", "pass"], user=uid, group=uid, extra_groups=[], timeout=30, cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if ok.returncode == 0:
            return exe
    return None


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another OS user needs root")
def test_another_os_user_is_refused(served: tuple[Path, ServeInfo], tmp_path: Path) -> None:
    """As uid 65534 (the standard library only): the key is unreadable and a TLS handshake without it is refused."""
    plan_dir, info = served
    assert info.tls is not None
    python = _python_for(65534)
    if python is None:
        pytest.skip("no Python interpreter that uid 65534 may run")
    host, port = info.scheduler.removeprefix("tls://").rsplit(":", 1)
    local = info.constructors[0].local
    assert local is not None
    code = f"""
import json, socket, ssl
out = {{"serve_json": json.load(open({str(serve_path(plan_dir))!r}))["scheduler"]}}
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(10); unix.connect({local.path!r}); unix.sendall(b"\\x00" * 64)
        out["unix"] = "answered" if unix.recv(1) else "closed"
except OSError as e:
    out["unix"] = type(e).__name__
try:
    open({info.tls.key!r}).read(); out["key"] = "read"
except OSError as e:
    out["key"] = type(e).__name__
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    with socket.create_connection(({host!r}, {port}), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        tls.sendall(b"x" * 64)
        out["handshake"] = "answered" if tls.recv(1) else "closed"
except (ssl.SSLError, OSError) as e:
    out["handshake"] = type(e).__name__
try:
    with socket.create_connection(({host!r}, {port}), timeout=10) as raw:
        raw.sendall(b"\\x00" * 64)
        out["plain"] = "answered" if raw.recv(1) else "closed"
except OSError as e:
    out["plain"] = type(e).__name__
print(json.dumps(out))
"""
    proc = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": "/"},
        user=65534,
        group=65534,
        extra_groups=[],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["serve_json"] == info.scheduler  # the plan and serve.json are readable to others...
    assert out["key"] == "PermissionError"  # ...the credentials are not
    assert out["handshake"] != "answered" and out["plain"] != "answered", out
    assert out["unix"] == "PermissionError", out  # the gateway's Unix socket: its folder is 0700


def _forge(plan_dir: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the plan dir whose serve.json is the real one with `changes` (what a writer of the dir could do).

    A forged scheduler address is also every constructor's gateway address (where ranks connect).
    """
    copy = tmp_path / "forged"
    shutil.copytree(plan_dir, copy, ignore=shutil.ignore_patterns("serve.json", "serve.lock", ".loom-tls"))
    real = read_serve_info(plan_dir)
    if "scheduler" in changes:  # and no same-host socket: a forged one is refused on its own (test_gateway_local)
        changes["constructors"] = [
            c.model_copy(update={"gateway": changes["scheduler"], "local": None}) for c in real.constructors
        ]
    write_serve_info(copy, real.model_copy(update=changes))
    return copy


def test_a_forged_serve_json_cannot_lead_a_rank_to_a_foreign_scheduler(
    served: tuple[Path, ServeInfo], tmp_path: Path
) -> None:
    plan_dir, info = served
    with open_cluster(n_workers=1, local_directory=tmp_path / "foreign") as foreign:
        address = foreign.scheduler.address
        # the real credentials: the foreign scheduler's certificate is not signed by the plan's CA
        forged = _forge(plan_dir, tmp_path, scheduler=address)
        with pytest.raises(ExecutionError), StreamClient(forged, 0, retry_s=3) as s:
            next(s)
        shutil.rmtree(forged)
        # the foreign cluster's own files, owned by another user
        foreign_tls = tmp_path / "foreign" / ".loom-tls"
        if os.getuid() == 0:
            for f in foreign_tls.iterdir():
                os.chown(f, 65534, 65534)
            tls = info.tls.model_copy(  # type: ignore[union-attr]
                update={
                    k: str(foreign_tls / n)
                    for k, n in (("ca_file", "ca.pem"), ("cert", "cert.pem"), ("key", "key.pem"))
                }
            )
            forged = _forge(plan_dir, tmp_path, scheduler=address, tls=tls)
            with pytest.raises(ExecutionError, match="owned by uid 65534"), StreamClient(forged, 0, retry_s=3) as s:
                next(s)
            shutil.rmtree(forged)
    # a plain-TCP scheduler: refused unless the client itself says insecure
    forged = _forge(plan_dir, tmp_path, scheduler="tcp://127.0.0.1:1", tls=None)
    with pytest.raises(ExecutionError, match="plain TCP"), StreamClient(forged, 0, retry_s=3) as s:
        next(s)


def test_insecure_with_require_encryption_is_a_clear_error(tmp_path: Path, served: tuple[Path, ServeInfo]) -> None:
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}
    proc = subprocess.run(
        [sys.executable, "-m", "loomdata.cli", "serve", str(served[0]), "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2 and "require-encryption" in proc.stderr and "Traceback" not in proc.stderr


def test_the_embedded_cluster_has_no_dashboard_and_keeps_http_on_loopback(tmp_path: Path) -> None:
    """No dashboard unless asked for; Dask's HTTP routes on a free loopback port (8787 is often taken)."""
    import urllib.error
    import urllib.request

    with open_cluster(n_workers=1, local_directory=tmp_path) as client:
        host, port = client.run_on_scheduler(
            lambda dask_scheduler: (dask_scheduler.http_server.address, dask_scheduler.http_server.port)
        )
        assert host == "127.0.0.1" and port != 8787  # not Dask's default port: no clash, no warning per start
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10)
        assert e.value.code == 404

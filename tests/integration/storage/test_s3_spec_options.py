"""An object store whose endpoint and credentials are only in the spec: index, plan and serve it (issue 9).

moto serves the tiny demo corpus on loopback; no `AWS_*` variable is set in any process that reads it (the
`loom` commands run with them removed, so their clusters' workers, spawned from them, have none either): the
spec's top-level `storage_options` name the endpoint, key and secret. plan.json holds no options, so serving
gets them from `loom serve --spec` (in memory, to each loader); four ranks read every step and every token
of the Parquet and JSONL sources is checked against an independent read of the local copy (the Megatron and
WebDataset samples by the loaders' per-sample checksums). Serving without the spec fails: the environment
really has no way to the store. The secret is in no file under the workdir, the plan dir (serve.json read
while serving), the object cache, nor in anything the commands printed or logged (Dask at debug level).

The Python API does the same with a mapping of source -> options, and loaders made later get them too: a
resize (`set_loaders`) and the recovery of a SIGKILLed worker's loaders, keeping no rows (every read a GET).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import yaml

from loomdata.client import StreamClient
from loomdata.execution import Executor, open_cluster
from loomdata.indexing import build_index
from loomdata.planning import make_plan
from loomdata.schemas import Batch, Spec, load_spec, parse_spec, read_plan
from loomdata.testing import generate_corpus
from loomtest.s3 import LocalOracle, S3Server
from loomtest.stream import kill_worker, write_corpus

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
LOOM = Path(sys.executable).parent / "loom"
BUCKET = "loom-spec-only"
PREFIX = f"s3://{BUCKET}/data"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Path]]:
    """moto on loopback with the corpus uploaded; no AWS variable set anywhere by it."""
    server = S3Server(tmp_path_factory.mktemp("s3cache"), set_env=False).start()
    root = tmp_path_factory.mktemp("corpus") / "data"
    generate_corpus(root, "tiny", seed=0)
    server.upload_dir(root, BUCKET, "data")
    try:
        yield server, root
    finally:
        server.stop()


def _env(cache: Path) -> dict[str, str]:
    """This process's environment without any AWS_* variable, Dask logging at debug (more to search)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("AWS_")}
    env.update({"LOOMDATA_CACHE_DIR": str(cache), "DASK_LOGGING__DISTRIBUTED": "debug", "PYTHONUNBUFFERED": "1"})
    return env


def _loom(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LOOM), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _spec_file(tmp: Path, server: S3Server) -> Path:
    raw = yaml.safe_load(CONFIG.read_text().replace("../demo-work/data", PREFIX))
    raw["workdir"] = str(tmp / "work")
    raw["training"]["steps"] = 12
    raw["storage_options"] = server.options()  # every source's (top level): endpoint, key and secret
    path = tmp / "spec" / "spec.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(raw))
    return path


class _Lines:
    """A process's output, line by line from a thread (a pipe never fills), kept whole for the leak check."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self.q: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)
            self.q.put(line)

    def wait_for(self, predicate: Any, proc: subprocess.Popen[str], timeout: float) -> str | None:
        """The first line `predicate` accepts; None when `proc` exited or `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=0.5)
            except queue.Empty:
                if proc.poll() is not None and self.q.empty():
                    return None
                continue
            if predicate(line):
                return line
        return None

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


def _check(batches: list[Batch], sources: list[str], oracle: LocalOracle, checked: dict[str, int]) -> None:
    """Every token of the oracle's sources in `batches` is the local copy's; counts them into `checked`."""
    for b in batches:
        starts = b.cu_seqlens[:-1]
        for k, (src, sample, off, ln) in enumerate(b.segments.tolist()):
            name = sources[src]
            if name in oracle.docs:
                want = oracle.docs[name][sample][off : off + ln]
                np.testing.assert_array_equal(b.input_ids[starts[k] : starts[k] + ln], want)
                checked[name] += ln


def _read_every_rank(plan_dir: Path, oracle: LocalOracle) -> dict[str, int]:
    meta = read_plan(plan_dir)
    checked = {name: 0 for name in oracle.docs}
    served = 0
    for rank in range(meta.dp_size):
        with StreamClient(plan_dir, rank, retry_s=60) as stream:
            batches = list(stream)
        served += len(batches)
        _check(batches, meta.sources, oracle, checked)
    assert served == meta.steps * meta.dp_size * meta.micro_batches
    return checked


def _files(*roots: Path) -> list[Path]:
    return [p for r in roots if r.exists() for p in r.rglob("*") if p.is_file()]


def test_endpoint_and_credentials_only_in_the_spec_reach_serving(store: tuple[S3Server, Path], tmp_path: Path) -> None:
    server, corpus = store
    env = _env(server.cache_dir)
    spec_path = _spec_file(tmp_path, server)
    secret = server.secret
    logs: list[str] = []

    indexed = _loom(env, "index", str(spec_path), "--json")
    logs += [indexed.stdout, indexed.stderr]
    assert indexed.returncode == 0, indexed.stderr[-3000:]
    planned = _loom(env, "plan", str(spec_path), "--json")
    logs += [planned.stdout, planned.stderr]
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan_dir = Path(json.loads(planned.stdout)["plan_dir"])
    assert "storage_options" not in (plan_dir / "plan.json").read_text()

    # The environment alone reaches no store: serving without the spec fails at its start, naming the bucket.
    blind = _loom(env, "serve", str(plan_dir), "--json", timeout=240)
    logs += [blind.stdout, blind.stderr]
    assert blind.returncode == 2 and f"s3://{BUCKET}/" in blind.stderr, blind.stderr[-3000:]

    spec: Spec = load_spec(spec_path, check_paths=False)  # no listing here: this process has no AWS_* either
    oracle = LocalOracle(spec, corpus, PREFIX)
    proc = subprocess.Popen(
        [str(LOOM), "serve", str(plan_dir), "--spec", str(spec_path), "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)  # type: ignore[arg-type]
    try:
        if out.wait_for(lambda line: '"event": "serving"' in line, proc, timeout=180) is None:
            proc.kill()
            pytest.fail(f"loom serve did not start: {err.text()[-3000:]}")
        serve_json = (plan_dir / "serve.json").read_bytes()
        assert secret.encode() not in serve_json
        while_serving = [p for p in _files(spec.workdir, plan_dir) if secret.encode() in p.read_bytes()]
        checked = _read_every_rank(plan_dir, oracle)
        assert set(checked) == {"web", "code", "books"} and all(n > 0 for n in checked.values()), checked
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    logs += [out.text(), err.text()]
    assert proc.returncode == 0, logs[-1][-3000:]

    assert while_serving == []
    written = [p for p in _files(spec.workdir, plan_dir, server.cache_dir) if p != spec_path]
    assert any(p.name == "plan.json" for p in written) and len(written) > 10
    assert [p for p in written if secret.encode() in p.read_bytes()] == []
    assert len("".join(logs)) > 1000 and [i for i, text in enumerate(logs) if secret in text] == []


def test_loaders_made_by_a_resize_or_after_a_worker_loss_get_the_options(
    store: tuple[S3Server, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    server, _ = store
    caplog.set_level(logging.DEBUG)  # this process's logs (executor, control loop, recovery, Dask client)
    for name in [k for k in os.environ if k.upper().startswith("AWS_")]:
        monkeypatch.delenv(name)  # before the cluster starts: its workers (and a restarted one) inherit this
    monkeypatch.setenv("LOOMDATA_CACHE_DIR", str(server.cache_dir))
    data = tmp_path / "data"
    write_corpus(data, "web", n_files=3, rows=40, seed=1)
    server.upload_dir(data, BUCKET, "resize")
    prefix = f"s3://{BUCKET}/resize"
    source = {"name": "web", "format": "parquet", "paths": [f"{prefix}/web/*.parquet"], "tokens_field": "tokens"}
    raw = {
        "name": "resize",
        "workdir": str(tmp_path / "work"),
        "sources": [{**source, "storage_options": server.options()}],
        "mixture": {"weights": {"web": 1.0}},
        "training": {"seq_len": 256, "steps": 12, "dp_size": 2, "micro_batches": 2},
    }
    spec = parse_spec(raw, tmp_path)
    with open_cluster(n_workers=2, local_directory=tmp_path / "dask") as client:
        build_index(spec, client)
        plan_dir = make_plan(spec).plan_dir
        oracle = LocalOracle(spec, data, prefix)
        meta = read_plan(plan_dir)
        # no rows kept, no read ahead: every step a loader serves is read from the store then
        settings: dict[str, Any] = {"window": 2, "bytes_in_flight": 0, "loader_memory": 0, "loader_prefetch": 0}
        with Executor(plan_dir, client, storage_options={"web": server.options()}, **settings) as ex:
            streams = {r: StreamClient(plan_dir, r, retry_s=90) for r in range(meta.dp_size)}
            got: dict[int, list[Batch]] = {r: [] for r in streams}

            def take(steps: range) -> None:
                for _ in steps:
                    for r, s in streams.items():
                        got[r] += [next(s) for _ in range(meta.micro_batches)]

            try:
                take(range(0, 4))
                assert ex.set_loaders("web", 3) == 3  # new loaders, made with the options
                take(range(4, 8))
                assert ex.info is not None
                victim = ex.info.loaders[0].worker
                lost = sum(lo.worker == victim for lo in ex.info.loaders)
                kill_worker(client, victim)
                deadline = time.monotonic() + 90
                while ex.recovery.recovered < 1:  # the loop recreates what the worker held
                    assert time.monotonic() < deadline, ex.recovery
                    time.sleep(0.05)
                take(range(8, meta.steps))
                assert all(next(s, None) is None for s in streams.values())
            finally:
                for s in streams.values():
                    s.close()
            after = ex.info
            recovered = ex.recovery.recovered
    assert lost >= 1 and recovered >= lost and after is not None and victim not in {lo.worker for lo in after.loaders}
    checked = {"web": 0}
    for r, batches in got.items():
        assert [(b.step, b.micro_batch) for b in batches] == [
            (s, m) for s in range(meta.steps) for m in range(meta.micro_batches)
        ], r
        _check(batches, meta.sources, oracle, checked)
    assert checked["web"] > 0
    printed = capfd.readouterr()  # file descriptors: the workers' own log lines too
    assert server.secret not in caplog.text and server.secret not in printed.out + printed.err
    written = _files(tmp_path / "work", server.cache_dir)
    assert len(written) > 5 and [p for p in written if server.secret.encode() in p.read_bytes()] == []

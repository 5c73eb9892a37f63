"""The `loom` command end to end, as a user runs it: generate, index, plan, inspect; errors without tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
_CREDENTIALS: dict[str, str] = {}  # LOOM_TLS_* of the session's TLS cluster, for `--scheduler` runs


@pytest.fixture(autouse=True)
def _cluster_credentials(request: pytest.FixtureRequest) -> None:
    """A test that uses `dask_client` runs `loom --scheduler` with that cluster's TLS files (LOOM_TLS_*)."""
    if "dask_client" in request.fixturenames:
        sec = request.getfixturevalue("dask_client").security
        _CREDENTIALS.update(
            LOOM_TLS_CA_FILE=sec.tls_ca_file, LOOM_TLS_CERT=sec.tls_client_cert, LOOM_TLS_KEY=sec.tls_client_key
        )


def _loom(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(_CREDENTIALS if "--scheduler" in args else {}), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "loomdata.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _json(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def demo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of configs/ next to a generated tiny corpus, laid out as in the repo."""
    root = tmp_path_factory.mktemp("cli")
    shutil.copytree(REPO / "configs", root / "configs")
    gen = _json(_loom("generate", "demo-work/data", "--size", "tiny", "--json", cwd=root))
    assert set(gen["sources"]) == {"web", "code", "books", "papers", "captions"}
    return root


def test_index_plan_inspect(demo_tree: Path, dask_client: Any) -> None:
    addr = dask_client.scheduler.address
    first = _json(_loom("index", "configs/demo.yaml", "--scheduler", addr, "--json", cwd=demo_tree))
    sources = first["sources"]
    assert set(sources) == {"web", "code", "books", "papers", "captions"}
    assert all(s["samples"] > 0 and s["tokens"] > 0 and s["skipped"] == 0 for s in sources.values())
    assert sources["captions"]["image_tokens"] > 0 and sources["web"]["image_tokens"] == 0
    again = _json(_loom("index", "configs/demo.yaml", "--scheduler", addr, "--json", cwd=demo_tree))
    assert all(s["rescanned"] == 0 for s in again["sources"].values())
    assert {k: v["fingerprint"] for k, v in again["sources"].items()} == {
        k: v["fingerprint"] for k, v in sources.items()
    }

    on_cluster = _json(_loom("plan", "configs/demo.yaml", "--scheduler", addr, "--json", cwd=demo_tree))
    cluster_dir = Path(on_cluster["plan_dir"]).rename(demo_tree / "cluster-plan")
    plan = _json(_loom("plan", "configs/demo.yaml", "--json", cwd=demo_tree))
    plan_dir = Path(plan["plan_dir"])
    assert (plan_dir / "plan.json").is_file()
    assert plan["plan_id"] == on_cluster["plan_id"]  # balanced on the cluster's workers: the same bytes
    files = sorted(p.relative_to(plan_dir) for p in plan_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(cluster_dir) for p in cluster_dir.rglob("*") if p.is_file())
    assert all((plan_dir / f).read_bytes() == (cluster_dir / f).read_bytes() for f in files)
    again_plan = _json(_loom("plan", "configs/demo.yaml", "--json", cwd=demo_tree))
    assert again_plan["plan_id"] == plan["plan_id"]

    png = demo_tree / "plan.png"
    inspected = _json(_loom("inspect", str(plan_dir), "--json", "--plot", str(png), cwd=demo_tree))
    assert inspected["plan_id"] == plan["plan_id"]
    assert png.stat().st_size > 10_000


def test_bad_spec_exits_2_with_every_problem_and_no_traceback(tmp_path: Path) -> None:
    spec = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    spec["sources"][0]["paths"] = ["nowhere/*.parquet"]
    spec["training"]["seq_len"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    proc = _loom("index", "bad.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "training.seq_len" in proc.stderr


def test_corrupt_shard_names_the_file(demo_tree: Path, dask_client: Any, tmp_path: Path) -> None:
    shutil.copytree(demo_tree / "configs", tmp_path / "configs")
    shutil.copytree(demo_tree / "demo-work" / "data", tmp_path / "demo-work" / "data")
    bad = sorted((tmp_path / "demo-work" / "data" / "web").glob("*.parquet"))[0]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    proc = _loom("index", "configs/demo.yaml", "--scheduler", dask_client.scheduler.address, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert bad.name in proc.stderr and "Traceback" not in proc.stderr


def test_demo_end_to_end(demo_tree: Path) -> None:
    """`loom demo` (what `make demo` runs): every stage, then 4 DDP ranks consume the whole plan."""
    report = _json(_loom("demo", "--json", cwd=demo_tree))
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    total = sum(r["tokens"] for r in ranks)
    assert total == report["plan"]["tokens"]
    assert all(r["all_ranks_tokens"] == total for r in ranks)
    assert all(r["first_loss"] > 0 and r["last_loss"] > 0 for r in ranks)
    imbalance = report["plan"]["imbalance"]
    assert imbalance["loomdata"]["mean"] < imbalance["baseline"]["mean"]
    assert report["executor"]["loader_samples"] > 0


def test_plan_resume_for_a_new_dp_size(demo_tree: Path, dask_client: Any, tmp_path: Path) -> None:
    """`loom plan --resume-from --at-step`: the base's steps are kept, the rest is planned for the new dp."""
    from loomdata.schemas import read_manifest, read_plan

    _json(_loom("index", "configs/demo.yaml", "--scheduler", dask_client.scheduler.address, "--json", cwd=demo_tree))
    base_dir = Path(_json(_loom("plan", "configs/demo.yaml", "--json", cwd=demo_tree))["plan_dir"])
    spec = yaml.safe_load((demo_tree / "configs" / "demo.yaml").read_text())
    spec["training"]["dp_size"] = 2
    (demo_tree / "configs" / "demo-dp2.yaml").write_text(yaml.safe_dump(spec))
    args = ("plan", "configs/demo-dp2.yaml", "--resume-from", str(base_dir), "--at-step", "10", "--json")
    new_dir = Path(_json(_loom(*args, cwd=demo_tree))["plan_dir"])
    base, new = read_plan(base_dir), read_plan(new_dir)
    assert new.dp_size == 2 and new.parameters.resume is not None and new.parameters.resume.base_plan_id == base.plan_id
    assert read_manifest(new_dir, new, 0, 9).equals(read_manifest(base_dir, base, 0, 9))
    later = read_manifest(new_dir, new, 10)
    assert set(later.column("dp_rank").to_pylist()) == {0, 1}
    assert set(later.column("step").to_pylist()) == set(range(10, 20))
    half = ("plan", "configs/demo-dp2.yaml", "--resume-from", str(base_dir))
    assert _loom(*half, cwd=demo_tree).returncode == 2


def test_a_rank_new_in_an_elastic_re_plan_must_start_at_its_first_step(
    demo_tree: Path, dask_client: Any, tmp_path: Path
) -> None:
    """dp 4 -> 6 from step 10: rank 5 has no batches before step 10; started at 0 it names step 10, not padding."""
    from loomdata.client import StreamClient
    from loomdata.schemas import ExecutionError

    _json(_loom("index", "configs/demo.yaml", "--scheduler", dask_client.scheduler.address, "--json", cwd=demo_tree))
    base_dir = _json(_loom("plan", "configs/demo.yaml", "--json", cwd=demo_tree))["plan_dir"]
    spec = yaml.safe_load((demo_tree / "configs" / "demo.yaml").read_text())
    spec["training"]["dp_size"] = 6
    (demo_tree / "configs" / "demo-dp6.yaml").write_text(yaml.safe_dump(spec))
    args = ("plan", "configs/demo-dp6.yaml", "--resume-from", str(base_dir), "--at-step", "10", "--json")
    new_dir = Path(_json(_loom(*args, cwd=demo_tree))["plan_dir"])
    with pytest.raises(ExecutionError, match="start_step=10"):
        StreamClient(new_dir, 5)
    StreamClient(new_dir, 5, start_step=10).close()  # from its first step it is a rank like any other
    StreamClient(new_dir, 3).close()  # a rank of the base plan starts at 0 as before


def test_a_key_given_twice_is_an_error_naming_it(demo_tree: Path, tmp_path: Path) -> None:
    text = (demo_tree / "configs" / "demo.yaml").read_text().replace("training:\n", "training:\n  steps: 5000\n", 1)
    spec = demo_tree / "configs" / "dup.yaml"
    spec.write_text(text)
    proc = _loom("plan", str(spec), cwd=demo_tree)
    assert proc.returncode == 2 and "training.steps: given twice" in proc.stderr and "Traceback" not in proc.stderr


def test_a_workdir_under_a_file_is_a_clear_error(demo_tree: Path, tmp_path: Path) -> None:
    spec = yaml.safe_load((demo_tree / "configs" / "demo.yaml").read_text())
    (tmp_path / "a-file").write_text("not a folder")
    spec["workdir"] = str(tmp_path / "a-file" / "work")
    (demo_tree / "configs" / "under-file.yaml").write_text(yaml.safe_dump(spec))
    for cmd in ("index", "plan"):
        proc = _loom(cmd, "configs/under-file.yaml", cwd=demo_tree)
        assert proc.returncode == 2, proc.stderr
        assert "which is a file, not a folder" in proc.stderr and "Traceback" not in proc.stderr


def test_certs_makes_a_private_ca_and_role_certificates(tmp_path: Path) -> None:
    out = _json(_loom("certs", str(tmp_path / "certs"), "--host", "node-1", "--json", cwd=tmp_path))
    assert set(out) == {"ca_file", "scheduler", "worker", "client"}
    assert (tmp_path / "certs").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "certs").iterdir())
    assert _loom("certs", str(tmp_path / "certs"), cwd=tmp_path).returncode == 2  # never over an existing CA


def test_serve_on_a_plain_tcp_scheduler_needs_insecure(stream_plan: Path, tmp_path: Path) -> None:
    proc = _loom("serve", str(stream_plan), "--scheduler", "tcp://127.0.0.1:1", cwd=tmp_path)
    assert proc.returncode == 2 and "--insecure" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("config", ["long-short", "multimodal"])
def test_example_configs_index_and_plan(demo_tree: Path, dask_client: Any, config: str) -> None:
    """The example specs in configs/ stay valid: they index and plan on the demo corpus."""
    from loomdata.schemas import read_manifest, read_plan

    spec = f"configs/{config}.yaml"
    _json(_loom("index", spec, "--scheduler", dask_client.scheduler.address, "--json", cwd=demo_tree))
    plan_dir = Path(_json(_loom("plan", spec, "--json", cwd=demo_tree))["plan_dir"])
    meta = read_plan(plan_dir)
    manifest = read_manifest(plan_dir, meta)
    assert set(manifest.column("step").to_pylist()) == set(range(meta.steps))
    if config == "long-short":
        assert meta.long_seq_len == 16384
        assert 1 in set(manifest.column("lane").to_pylist())
    else:
        captions = meta.sources.index("captions")
        assert captions in set(manifest.column("source").to_pylist())


def test_bench_configs_validate() -> None:
    from loomdata.schemas import load_spec

    for name in ("bench-short", "bench-long"):
        spec = load_spec(REPO / "configs" / f"{name}.yaml", check_paths=False)
        assert spec.training.dp_size > 0


def test_progress_bar_on_a_terminal_only(demo_tree: Path, dask_client: Any, tmp_path: Path) -> None:
    """On a terminal `loom index` shows a progress bar (on stderr); piped, it prints none."""
    import fcntl
    import pty
    import struct
    import termios

    shutil.copytree(demo_tree / "configs", tmp_path / "configs")
    shutil.copytree(demo_tree / "demo-work" / "data", tmp_path / "demo-work" / "data")
    args = [sys.executable, "-m", "loomdata.cli", "index", "configs/demo.yaml"]
    args += ["--scheduler", dask_client.scheduler.address]
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    env = {**os.environ, **_CREDENTIALS}
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=secondary, text=True, env=env)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 4096)
        except OSError:  # the terminal closed: the process exited
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(primary)
    assert proc.returncode == 0
    assert "loom index" in b"".join(chunks).decode(errors="replace")  # the tqdm bar's description
    (tmp_path / "demo-work" / "work").rename(tmp_path / "old-work")  # force a rescan, now piped
    piped = _loom("index", "configs/demo.yaml", "--scheduler", dask_client.scheduler.address, cwd=tmp_path)
    assert piped.returncode == 0 and "loom index" not in piped.stderr


def test_serve_refuses_a_bad_setting_before_starting_a_cluster(tmp_path: Path) -> None:
    """`loom serve --window 0`: the ServeConfig built at the edge names the field; exit 2, no traceback."""
    proc = _loom("serve", str(tmp_path), "--window", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "ServeConfig.window must be >= 1" in proc.stderr and "Traceback" not in proc.stderr

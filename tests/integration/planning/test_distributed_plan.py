"""Planning on a real LocalCluster (2 worker processes) gives the one-process plan byte for byte.

Every file of the plan dir is compared (manifest partitions, report tables, plan.json), planned in the
same workdir one after the other. Partitions are made small so the steps are cut into many ranges; the
image case carries deferred samples across range boundaries (asserted from the plan's own report), so
the speculative ranges must be fixed up to be exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from loomdata.execution._dask_client import live_workers
from loomdata.planning import _manifest as manifest_module
from loomdata.planning import make_plan
from loomdata.schemas.plan import read_plan
from loomtest.golden_plans import CASES


def _files(plan_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(plan_dir).as_posix(): p.read_bytes() for p in sorted(plan_dir.rglob("*")) if p.is_file()}


def _plan_twice(
    name: str, wd: Path, client: Any, ranges: int | None
) -> tuple[Path, dict[str, bytes], dict[str, bytes]]:
    """(single-process plan dir kept aside, its files, the cluster plan's files) of golden case `name`."""
    spec, index, kw = CASES[name](wd)
    single = make_plan(spec, index=index, **kw).plan_dir
    kept = single.rename(single.with_name("single-process"))
    spec, index, kw = CASES[name](wd)
    dist = make_plan(spec, index=index, client=client, ranges=ranges, **kw).plan_dir
    assert dist.name == single.name  # the same plan id
    return kept, _files(kept), _files(dist)


@pytest.mark.parametrize(
    ("name", "ranges", "carries", "speculate"),
    [
        ("images_defer_dp3", 1000, True, True),  # every partition its own range: carries cross range bounds
        ("images_defer_dp3", None, True, False),  # the default number of ranges (4 per worker)
        ("web4k_dp8", None, False, True),  # the first ranges on a prefix's look-ahead
        ("web4k_dp8", None, False, False),  # the whole look-ahead first
        ("elastic_images_in_flight", 1000, True, None),  # a re-plan: the base's last partition is finished here
    ],
)
def test_cluster_plan_is_byte_identical(
    name: str,
    ranges: int | None,
    carries: bool,
    speculate: bool | None,
    tmp_path: Path,
    dask_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from loomdata.planning import _plan as plan_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 40)
    monkeypatch.setattr(plan_module, "SPECULATE", speculate)  # (None: this host's cores decide; a re-plan never)
    if speculate:  # a prefix short of the last step, so the first ranges do go out on it
        monkeypatch.setattr(plan_module, "EARLY_MARGIN", 0)
    single, want, got = _plan_twice(name, tmp_path, dask_client, ranges)
    meta = read_plan(single)
    assert len(meta.manifest) > 8
    deferred = pq.read_table(single / "report" / "steps.parquet")["deferred_tokens"].to_numpy()
    ends = np.array([f.last_step for f in meta.manifest[:-1]])
    crossing = int((deferred[ends] > 0).sum())  # partition bounds a carry crosses
    assert (crossing > 0) == carries, crossing
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []


def test_the_shared_work_goes_to_the_plans_folder_where_memory_is_not_shared_and_is_removed(
    tmp_path: Path, dask_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a memory filesystem every worker sees, the work the workers read is written into the plan's
    temporary folder (what they must share anyway); the plan is the same bytes and keeps none of it."""
    from loomdata.planning import _distributed as distributed_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 40)
    monkeypatch.setattr(distributed_module, "_MEMORY_FS", tmp_path / "no-such-filesystem")
    folders: list[Path] = []
    real = distributed_module.SharedWork.write

    def write(work: Any, folder: Path, *args: Any, **kwargs: Any) -> Any:
        folders.append(folder)
        return real(work, folder, *args, **kwargs)

    monkeypatch.setattr(distributed_module.SharedWork, "write", write)
    _, want, got = _plan_twice("web4k_dp8", tmp_path, dask_client, 6)
    assert [f.name for f in folders] == [".work"] and folders[0].parent.name.startswith(".tmp-")
    assert not folders[0].exists()
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []


def test_the_shared_work_in_memory_is_a_private_fresh_folder_removed_after_the_plan(
    tmp_path: Path, dask_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every worker sees the memory filesystem (here a folder standing in for /dev/shm on this host), the
    work goes into a fresh folder only this user can write, and nothing of it is left once the plan is done."""
    import stat

    from loomdata.planning import _distributed as distributed_module

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 40)
    monkeypatch.setattr(distributed_module, "_MEMORY_FS", shm)
    modes: list[tuple[Path, int]] = []
    real = distributed_module.SharedWork.write

    def write(work: Any, folder: Path, *args: Any, **kwargs: Any) -> Any:
        shared = real(work, folder, *args, **kwargs)
        modes.append((folder, stat.S_IMODE(folder.stat().st_mode)))
        return shared

    monkeypatch.setattr(distributed_module.SharedWork, "write", write)
    _, want, got = _plan_twice("web4k_dp8", tmp_path, dask_client, 6)
    assert len(modes) == 1 and modes[0][0].parent == shm and modes[0][0].name.startswith("loom-plan-")
    assert modes[0][1] == 0o700
    assert list(shm.iterdir()) == []
    assert [k for k in want if got[k] != want[k]] == [] and sorted(got) == sorted(want)


@pytest.mark.parametrize("agree", [True, False])
def test_the_first_ranges_on_a_prefix_look_ahead_share_the_index_with_the_whole_work(
    agree: bool, tmp_path: Path, dask_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the cluster the first ranges are balanced on a prefix's look-ahead while the whole is worked out; the
    whole work is written beside the first in the same folder, adding only its own arrays (the assignment's: a
    position and a step array a source), not the index columns and streams again; the prefix's own arrays are
    read back from their files (not held twice); where the two disagree (a prefix ending before the first ranges
    do), those ranges are sent again on the whole work; the plan is the one-process plan byte for byte. The whole's
    assignment is made in the shared folder's files (_file_arrays), so writing the whole work copies no array."""
    from loomdata.planning import _distributed as distributed_module
    from loomdata.planning import _plan as plan_module

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 40)
    monkeypatch.setattr(distributed_module, "_MEMORY_FS", shm)
    lookahead = CASES["web4k_dp8"](tmp_path / "probe")[0].planning.lookahead
    monkeypatch.setattr(plan_module, "EARLY_MARGIN", 0 if agree else -8 * (lookahead + 1) - 3)
    monkeypatch.setattr(plan_module, "SPECULATE", True)  # (by default only where a core is left beside the workers)
    monkeypatch.setattr(distributed_module, "_FILE_MIN", 1 << 10)  # this small plan's assignments as files too
    mapped: list[int] = []
    real_map = distributed_module._map_written

    def map_written(asg: Any, folder: Path, saved: Any) -> None:
        real_map(asg, folder, saved)
        mapped.append(sum(isinstance(a, np.memmap) for a in (*asg.pos, *asg.step)))

    monkeypatch.setattr(distributed_module, "_map_written", map_written)
    written: list[tuple[str, int, int]] = []  # (pickle name, .npy files the pickler and the allocator made, after it)
    real = distributed_module.SharedWork.write

    def write(work: Any, folder: Path, *args: Any, **kwargs: Any) -> Any:
        shared = real(work, folder, *args, **kwargs)
        stems = [p.stem for p in folder.glob("*.npy")]
        written.append((shared.name, sum(s.isdigit() for s in stems), sum(s.startswith("a") for s in stems)))
        return shared

    monkeypatch.setattr(distributed_module.SharedWork, "write", write)
    sent: list[tuple[str, int, int]] = []  # (the shared work's name, first step, stop) of each range sent
    real_submit = dask_client.submit

    def submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is distributed_module._shared_range:
            sent.append((args[0].name, args[2], args[3]))
        return real_submit(fn, *args, **kwargs)

    monkeypatch.setattr(dask_client, "submit", submit)
    _, want, got = _plan_twice("web4k_dp8", tmp_path, dask_client, 6)
    early = plan_module.early_ranges(6, 2)
    assert len(sent) == 6 + (0 if agree else early)
    assert {n for n, *_ in sent[:early]} == {"work.pkl"} and {n for n, *_ in sent[early:]} == {"whole.pkl"}
    if not agree:  # the first ranges again, on the whole work
        assert [r for _, *r in sent[:early]] == [r for _, *r in sent[early : 2 * early]]
    assert [n for n, *_ in written] == ["work.pkl", "whole.pkl"]
    # the whole's assignment made in the folder as the look-ahead worked it out (all sources' steps in one file, a
    # positions file a source: 2 sources), so its pickle writes no array of its own
    assert written[0][2] == 0 and written[1][1:] == (written[0][1], 3), written
    assert mapped == [4]  # the prefix's positions and steps, read back from their files
    assert list(shm.iterdir()) == []
    assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []


def test_the_cluster_s_worker_threads_on_this_host_are_counted(dask_client: Any) -> None:
    """The embedded cluster's workers listen on this host: all their threads are local (what decides whether a
    plan speculates by default: only with a core left beside them)."""
    from loomdata.planning._distributed import local_threads

    workers = live_workers(dask_client)
    assert local_threads(dask_client) == sum(w["nthreads"] for w in workers.values()) >= 2


def test_in_process_workers_count_as_this_hosts_threads() -> None:
    """A LocalCluster of threads (processes=False) listens on `inproc://` addresses, which name no host: its
    workers report this host's identity, so their threads count as local (they fill this host's cores)."""
    from distributed import Client, LocalCluster

    from loomdata.planning._distributed import local_threads

    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert all(a.startswith("inproc://") for a in live_workers(client))
        assert local_threads(client) == 2


def test_each_worker_is_warmed_once_while_the_serial_part_runs_and_the_plan_is_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster plan sends each worker of a fresh cluster a warming task as it starts (planning._warm: a tiny real
    plan loading every kernel a range calls), once; the plan is the one-process plan byte for byte, warmed or not."""
    from distributed import Client, LocalCluster

    from loomdata.planning import _plan as plan_module
    from loomdata.planning import _warm as warm_module

    monkeypatch.setattr(manifest_module, "ROWS_PER_FILE", 40)
    monkeypatch.setattr(warm_module, "_SENT", set())
    sent: list[Any] = []
    real_hold, real_weights = warm_module._hold, plan_module.step_weights

    def hold(fut: Any) -> None:
        sent.append(fut)
        real_hold(fut)

    def after_warming(spec: Any) -> Any:  # the serial part waits for the warming (a tiny plan's is too short)
        for fut in sent:
            fut.result(timeout=120)
        return real_weights(spec)

    monkeypatch.setattr(warm_module, "_hold", hold)
    monkeypatch.setattr(plan_module, "step_weights", after_warming)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        workers = sorted(live_workers(client))
        assert client.run(warm_module.warm_seconds) == dict.fromkeys(workers)  # cold
        _, want, got = _plan_twice("web4k_dp8", tmp_path / "warm", client, None)
        assert len(sent) == 2 and all(f.result() > 0 for f in sent)  # one each, warming it
        seconds = client.run(warm_module.warm_seconds)
        assert sorted(seconds) == workers and all(s is not None and s > 0 for s in seconds.values())
        assert sorted(got) == sorted(want) and [k for k in want if got[k] != want[k]] == []
        assert warm_module.warm_workers(client, plan_module._warm_task) == 0  # remembered: not sent again

        monkeypatch.setattr(plan_module, "warm_workers", lambda client, task: 0)  # no warming
        _, single, cold = _plan_twice("web4k_dp8", tmp_path / "cold", client, None)
        assert sorted(cold) == sorted(single) and [k for k in single if cold[k] != single[k]] == []
        assert [k for k in want if k != "plan.json" and cold[k] != got[k]] == []  # (plan.json names its workdir)

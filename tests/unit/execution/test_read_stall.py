"""When a loader of local files reads ahead (`local_read_ahead` auto): the decision rule on measured inputs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader_cache import CachePolicy, PlanUnitCache, unit_key
from loomdata.execution._prefetch import (
    QUIET_WINDOWS,
    SLOW_READ_S,
    STALL_MIN_READS,
    STALL_WINDOW_S,
    STORAGE_MIN_BYTES,
    Prefetcher,
    ReadStall,
    counts_storage,
    judge_stall,
    mount_types,
    read_stall,
    storage_read_bytes,
)
from loomdata.schemas import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources.parquet import ParquetReader

SRC = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
MIB = 1 << 20


def _reads(ms: float, n: int = 16) -> np.ndarray:
    return np.full(n, ms / 1e3)


def test_slow_reads_from_storage_turn_the_read_ahead_on() -> None:
    """A cold disk: 16 reads of 12 ms in 0.6 s (32% of the time), 8 MiB from storage."""
    got = judge_stall(False, _reads(12), 0.6, 0, 8 * MIB)
    assert got is not None and got[0] is True
    assert "16 reads in 0.60 s, median 12.0 ms, 32% of the time, 8.0 MiB from storage" in got[2]


def test_reads_slow_only_for_want_of_a_cpu_keep_it_off() -> None:
    """Measured on 2 loaded cores at 4 consumers: cached files, median 9.4 ms, 66% of the time, nothing from storage."""
    got = judge_stall(False, _reads(9.4, 32), 0.71, 0, 0)
    assert got is not None and got[0] is False
    got = judge_stall(False, _reads(9.4, 32), 0.71, 0, STORAGE_MIN_BYTES - 1)  # a little: an import, an index read
    assert got is not None and got[0] is False


def test_fast_or_rare_reads_keep_it_off_even_from_storage() -> None:
    fast = judge_stall(False, _reads(1.0), 0.6, 0, 8 * MIB)  # a fast disk
    rare = judge_stall(False, _reads(20, STALL_MIN_READS), 5.0, 0, 8 * MIB)  # slow, but 3% of the time
    assert fast is not None and fast[0] is False and rare is not None and rare[0] is False


def test_too_short_a_window_or_too_few_reads_is_not_judged() -> None:
    assert judge_stall(False, _reads(30), STALL_WINDOW_S * 0.9, 0, 8 * MIB) is None
    assert judge_stall(False, _reads(30, STALL_MIN_READS - 1), 1.0, 0, 8 * MIB) is None
    # long enough with few reads: judged (off: reads that rare stall nothing)
    got = judge_stall(False, _reads(30, 2), 10 * STALL_WINDOW_S, 0, 8 * MIB)
    assert got is not None and got[:2] == (False, 0)


def test_without_a_storage_measure_the_times_alone_decide() -> None:
    got = judge_stall(False, _reads(12), 0.6, 0, None)
    assert got is not None and got[0] is True and "storage not measured" in got[2]


def test_once_on_it_turns_off_only_after_quiet_windows_in_a_row() -> None:
    on, quiet = True, 0
    for i in range(QUIET_WINDOWS - 1):  # reads ahead now fast (the page cache holds the files)
        got = judge_stall(on, _reads(SLOW_READ_S * 1e3 / 4), 0.6, quiet, 8 * MIB)
        assert got is not None
        on, quiet, _ = got
        assert on is True and quiet == i + 1
    got = judge_stall(on, _reads(12), 0.6, quiet, 8 * MIB)  # one slow window: the count starts again
    assert got is not None and got[:2] == (True, 0)
    on, quiet = True, 0
    for _ in range(QUIET_WINDOWS):  # nothing read from storage: quiet however long the reads took
        got = judge_stall(on, _reads(12), 0.6, quiet, 0)
        assert got is not None
        on, quiet, _ = got
    assert (on, quiet) == (False, 0)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_read_stall_measures_windows_and_logs_each_turn_with_its_inputs(caplog: pytest.LogCaptureFixture) -> None:
    clock, stored = _Clock(), [0]
    stall = ReadStall("auto", "web-0", clock=clock, stored=lambda: stored[0])
    assert stall.ahead() is False  # nothing measured
    for _ in range(16):
        stall.note(0.012)
        clock.t += 0.035
        stored[0] += MIB // 2
    assert stall.timed == 16
    with caplog.at_level(logging.INFO, logger="loomdata.execution._prefetch"):
        assert stall.ahead() is True
    assert [on for on, _ in stall.turns] == [True]
    assert "local read-ahead web-0: on (16 reads in 0.57 s, median 12.0 ms, 34% of the time, 8.0 MiB from storage" in (
        caplog.text
    )
    for _ in range(QUIET_WINDOWS):  # reads ahead from the page cache now
        for _ in range(16):
            stall.note(0.001)
            clock.t += 0.04
        stall.ahead()
    assert stall.on is False and [on for on, _ in stall.turns] == [True, False]


class _ClosingClock(_Clock):
    """A clock whose next read closes the stall's window, as another thread's judgement would between the
    unlocked check and the lock (the race a review found: `ahead` read `_since` twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.stall: ReadStall | None = None
        self.close_on_read = -1

    def __call__(self) -> float:
        self.close_on_read -= 1
        if self.close_on_read == 0 and self.stall is not None:
            self.stall._since = None  # another thread judged the window meanwhile
        return self.t


def test_a_window_closed_by_another_thread_meanwhile_is_not_judged_again() -> None:
    clock = _ClosingClock()
    stall = ReadStall("auto", "x", clock=clock, stored=lambda: 8 * MIB)
    clock.stall = stall
    for _ in range(16):
        stall.note(0.012)
        clock.t += 0.035
    clock.close_on_read = 1  # the unlocked check's own clock read closes the window
    assert stall.ahead() is False and not stall.turns  # no TypeError; nothing left to judge


def test_turns_kept_are_bounded() -> None:
    clock = _Clock()
    stall = ReadStall("auto", "x", clock=clock, stored=lambda: 0)
    assert stall.turns.maxlen is not None and stall.turns.maxlen <= 64


def test_mount_types_pick_the_longest_mount_point_above_a_path(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /mnt/data rw,relatime shared:2 - nfs4 server:/export rw,vers=4.2\n"
        "31 22 0:41 / /mnt/my\\040disk rw - fuse.s3fs s3fs rw\n"
        "32 30 0:42 / /mnt/data/local rw - xfs /dev/sdb1 rw\n"
    )
    got = mount_types(["/etc/x", "/mnt/data/a/b", "/mnt/data/local/c", "/mnt/my disk/d", "/mnt/datas"], str(info))
    assert got == ["ext4", "nfs4", "xfs", "fuse.s3fs", "ext4"]
    assert mount_types(["/x"], str(tmp_path / "none")) == [None]


def test_files_on_a_network_filesystem_are_judged_by_their_times_alone(tmp_path: Path) -> None:
    assert counts_storage([str(tmp_path / "a.parquet")]) is (mount_types([str(tmp_path)])[0] not in (None, "nfs4"))
    # a network filesystem's reads may not show in the block input: read_stall leaves the storage condition out
    here = read_stall("auto", "x", {0: tmp_path / "a.parquet"})
    assert (here._read_stored() is None) is (not counts_storage([str(tmp_path / "a.parquet")]))
    assert read_stall("on", "x", {0: tmp_path / "a.parquet"})._read_stored is storage_read_bytes


def test_forced_modes_never_change_and_time_nothing() -> None:
    clock = _Clock()
    for mode, on in (("on", True), ("off", False)):
        stall = ReadStall(mode, "x", clock=clock, stored=lambda: 10 * MIB)
        for _ in range(32):
            stall.note(0.05)
            clock.t += 0.05
        assert stall.ahead() is on and stall.timed == 0 and not stall.turns


def test_begin_and_end_time_only_the_read_of_the_unit_missed() -> None:
    stall = ReadStall("auto", "x", stored=lambda: 0)
    stall.begin(7)
    stall.end(8)  # another unit's rows: not the read timed (and the timing is dropped)
    stall.end(7)
    assert stall.timed == 0
    stall.begin(7)
    stall.end(7)
    assert stall.timed == 1


def test_storage_read_bytes_counts_a_read_the_page_cache_did_not_hold(tmp_path: Path) -> None:
    """The storage measure is real: a file's pages dropped (`POSIX_FADV_DONTNEED`, no root needed) are read from disk,
    the same pages read again are not."""
    if not hasattr(os, "posix_fadvise") or storage_read_bytes() is None:
        pytest.skip("no posix_fadvise or no block-input counter on this platform")
    p = tmp_path / "cold.bin"
    p.write_bytes(os.urandom(4 * MIB))
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = storage_read_bytes()
        while os.read(fd, MIB):
            pass
        cold = storage_read_bytes() - before  # type: ignore[operator]
        os.lseek(fd, 0, os.SEEK_SET)
        before = storage_read_bytes()
        while os.read(fd, MIB):
            pass
        warm = storage_read_bytes() - before  # type: ignore[operator]
    finally:
        os.close(fd)
    if cold == 0:
        pytest.skip("this filesystem does not count block input (tmpfs?)")
    assert cold >= 2 * MIB and warm < STORAGE_MIN_BYTES


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    p = tmp_path / "s.parquet"
    pq.write_table(
        pa.table({"ids": pa.array([[r, r + 1] for r in range(24)], pa.list_(pa.int32()))}), p, row_group_size=3
    )
    return p


def _prefetcher(shard: Path, mode: str, name: str) -> tuple[Prefetcher, PlanUnitCache]:
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=6, prefetch=4, local_read_ahead=mode)
    cache = PlanUnitCache(name, steps=50, policy=policy, shard_of={str(shard): 3})
    pf = Prefetcher(cache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: shard}, 4, "t")
    cache.plan(unit_key(3, np.arange(8)), np.arange(8))  # step s reads row group s
    return pf, cache


def test_a_local_loader_in_auto_reads_inline_times_its_misses_and_reads_ahead_once_stalled(shard: Path) -> None:
    pf, cache = _prefetcher(shard, "auto", "p-auto")
    try:
        pf.pump(np.array([0]))
        assert pf.settle(10) and pf.counters.issued == 0  # off until reads stall
        reader = ParquetReader(SRC, TokenizerSpec(), ImageSpec())
        reader.use_unit_cache(pf)
        reader.read(shard, np.array([0, 3]))  # rows of units 0 and 1: the reader's own reads, timed
        assert pf.stall.timed == 2
        clock = _Clock()
        pf.stall = ReadStall("auto", "t", clock=clock, stored=iter(range(0, 100 * MIB, MIB)).__next__)
        for _ in range(16):  # a cold disk's reads
            pf.stall.note(0.02)
            clock.t += 0.04
        pf.pump(np.array([0]))
        assert pf.settle(10) and pf.counters.issued > 0 and pf.stall.on
    finally:
        pf.close()
        cache.close()


def test_a_local_loader_forced_on_reads_ahead_at_once_and_object_urls_always_do(shard: Path) -> None:
    pf, cache = _prefetcher(shard, "on", "p-on")
    try:
        pf.pump(np.array([0]))
        assert pf.settle(10) and pf.counters.issued > 0
    finally:
        pf.close()
        cache.close()
    url = "memory://loomstall/s.parquet"
    policy = CachePolicy(worker_bytes=1 << 20, horizon_steps=6, prefetch=4, local_read_ahead="off")
    ucache = PlanUnitCache("p-url-off", steps=50, policy=policy, shard_of={url: 3})
    upf = Prefetcher(ucache, lambda: ParquetReader(SRC, TokenizerSpec(), ImageSpec()), {3: url}, 4, "t")
    try:
        assert upf.stall.mode == "on" and upf.stall.ahead()  # `local_read_ahead` is for local files only
    finally:
        upf.close()
        ucache.close()


def test_the_setting_is_checked_and_reaches_the_loaders_policy() -> None:
    from loomdata.cli import _parser
    from loomdata.execution._config import ServeConfig

    assert ServeConfig().local_read_ahead == "auto"
    assert CachePolicy.serving(ServeConfig(local_read_ahead="off")).local_read_ahead == "off"
    assert CachePolicy(worker_bytes=1, horizon_steps=1).local_read_ahead == "on"  # a policy made directly: as before
    with pytest.raises(ValueError, match="local_read_ahead"):
        ServeConfig(local_read_ahead="sometimes")
    with pytest.raises(ValueError, match="local_read_ahead"):
        CachePolicy(worker_bytes=1, horizon_steps=1, local_read_ahead="yes")
    args = _parser().parse_args(["serve", "plan", "--local-read-ahead", "on"])
    assert args.local_read_ahead == "on"
    assert _parser().parse_args(["serve", "plan"]).local_read_ahead == "auto"

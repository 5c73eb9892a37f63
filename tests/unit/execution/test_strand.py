"""Strands: serial, in-order jobs on a few shared threads, however many strands a process has."""

from __future__ import annotations

import threading

import pytest

from loomdata.execution._strand import STRAND_THREADS, Strand, strand_threads


def test_a_strand_runs_its_jobs_one_at_a_time_in_order() -> None:
    s = Strand("t")
    seen: list[int] = []
    live, peak = [0], [0]

    def job(i: int) -> int:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        sum(range(5000))  # some work while others could overlap
        seen.append(i)
        live[0] -= 1
        return i * i

    futs = [s.submit(job, i) for i in range(50)]
    assert [f.result(10) for f in futs] == [i * i for i in range(50)]
    assert seen == list(range(50)) and peak[0] == 1


def test_many_strands_share_the_process_threads_and_overlap() -> None:
    strands = [Strand(f"s{i}") for i in range(3 * STRAND_THREADS)]
    names: set[str] = set()
    barrier = threading.Barrier(2, timeout=10)

    def job() -> None:
        names.add(threading.current_thread().name)

    futs = [s.submit(job) for s in strands for _ in range(3)]
    for f in futs:
        f.result(10)
    assert names and all(n.startswith("loom-strand") for n in names) and len(names) <= STRAND_THREADS
    a, b = Strand("a"), Strand("b")  # two strands run at once (each waits for the other at the barrier)
    fa, fb = a.submit(barrier.wait), b.submit(barrier.wait)
    fa.result(10), fb.result(10)
    assert strand_threads() is strand_threads()


def test_a_failing_job_reaches_its_caller_and_the_strand_goes_on() -> None:
    s = Strand("f")

    def bad() -> None:
        raise KeyError("row 7")

    f1, f2 = s.submit(bad), s.submit(lambda: 3)
    with pytest.raises(KeyError, match="row 7"):
        f1.result(10)
    assert f2.result(10) == 3


def test_shutdown_waits_for_queued_jobs_and_refuses_new_ones() -> None:
    s = Strand("d")
    done: list[int] = []
    gate = threading.Event()
    s.submit(gate.wait, 10)
    s.submit(done.append, 1)
    threading.Timer(0.05, gate.set).start()
    s.shutdown(wait=True)
    assert done == [1]
    with pytest.raises(RuntimeError, match="strand 'd' is shut down"):
        s.submit(done.append, 2)

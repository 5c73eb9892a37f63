"""planning._allocator.plan_heap: glibc's heap thresholds set once a planning process, unless the environment chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loomdata import _glibc
from loomdata.planning._allocator import heap_settable

# In a fresh process: 20 rounds of 50 arrays of 96 KB (each below glibc's initial 128 KB mmap threshold, so from the
# heap), all freed at the end of each round: the ~4.7 MB at the heap's top is given back at once where the trim
# threshold is still the initial 128 KB, and faulted in again by the next round.
CHILD = """
import resource, sys
import numpy as np
from loomdata.planning._allocator import plan_heap
if sys.argv[1] == "set":
    assert plan_heap() and plan_heap()  # once; the cached answer again
f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    arrays = [np.ones(12_000) for _ in range(50)]
    del arrays
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if heap_settable({k: v})}  # without any MALLOC_* choice
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(_glibc.glibc() is None, reason="glibc's allocator only")
def test_a_heap_top_freed_and_allocated_again_is_kept_once_plan_heap_ran() -> None:
    adaptive, set_ = _faults("adaptive"), _faults("set")
    assert adaptive > 10_000  # every round faulted its ~1,150 pages in again
    assert set_ < adaptive / 4  # the pages stayed at the heap's top


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "65536"},  # what Dask's nannies set
        {"MALLOC_MMAP_THRESHOLD_": "1048576"},
        {"MALLOC_TOP_PAD_": "0"},
        {"MALLOC_MMAP_MAX_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=65536"},
    ],
)
def test_a_choice_in_the_environment_is_left_alone(environ: dict[str, str]) -> None:
    assert not heap_settable(environ)


def test_an_environment_without_heap_settings_may_set_them() -> None:
    assert heap_settable({"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"})

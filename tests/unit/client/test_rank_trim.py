"""A rank trims its C heap at most every `TRIM_EVERY_S`, on the calling thread (no thread started for it)."""

from __future__ import annotations

import threading

from loomdata import _glibc
from loomdata.client._trim import TRIM_EVERY_S, RankTrim


def test_the_first_call_trims_and_later_ones_wait_for_the_interval() -> None:
    trim = RankTrim()
    glibc = _glibc.glibc() is not None
    assert trim.maybe_trim(now=100.0) is glibc
    assert not trim.maybe_trim(now=100.0 + TRIM_EVERY_S / 2)
    assert trim.maybe_trim(now=100.0 + TRIM_EVERY_S) is glibc
    assert trim.trims == (2 if glibc else 0)


def test_trimming_starts_no_thread() -> None:
    before = threading.active_count()
    RankTrim().maybe_trim()
    assert threading.active_count() == before

"""ServeConfig, Autoscaling and Timings: frozen, validated, every bad value named by its field."""

from __future__ import annotations

import dataclasses

import pytest

from loomdata.execution import Autoscaling, ServeConfig, Timings
from loomdata.execution._config import (
    DEFAULT_BYTES_IN_FLIGHT,
    DEFAULT_CONSTRUCTOR_BYTES,
    MAX_STEPS_AHEAD,
    SHARED_FLOOR_STEPS,
)
from loomdata.execution._window import step_bytes


def test_defaults_are_the_documented_ones() -> None:
    c = ServeConfig()
    assert (c.constructors, c.window, c.n_workers, c.recover, c.autoscale) == (1, 2, 2, True, None)
    assert c.timings.recovery_every_s == 0.2 and c.timings.client_retry_s == 60.0
    assert c.loaders_for("web") == 1
    assert c.loader_memory == 256 * 1024 * 1024  # per worker, shared by its loaders


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ServeConfig(window=0), "ServeConfig.window"),
        (lambda: ServeConfig(constructors=0), "ServeConfig.constructors"),
        (lambda: ServeConfig(peers=0), "ServeConfig.peers"),
        (lambda: ServeConfig(n_workers=-1), "ServeConfig.n_workers"),
        (lambda: ServeConfig(metrics_every_s=0), "ServeConfig.metrics_every_s"),
        (lambda: ServeConfig(loaders_per_source={"web": 0}), "ServeConfig.loaders_per_source"),
        (lambda: ServeConfig(start_step=-1), "ServeConfig.start_step"),
        (lambda: ServeConfig(loader_memory=-1), "ServeConfig.loader_memory"),
        (lambda: ServeConfig(bytes_in_flight=-1), "ServeConfig.bytes_in_flight"),
        (lambda: Timings(call_timeout_s=0), "Timings.call_timeout_s"),
        (lambda: Timings(create_attempts=0), "Timings.create_attempts"),
        (lambda: Autoscaling(min_change=-1), "Autoscaling.min_change"),
    ],
)
def test_a_bad_value_raises_value_error_naming_its_field(make: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()  # type: ignore[operator]


def test_frozen_and_overridable() -> None:
    c = ServeConfig(loaders_per_source={"web": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.window = 3  # type: ignore[misc]
    assert c.loaders_for("web") == 3 and c.loaders_for("code") == 1
    d = c.with_settings(window=4, autoscale=True)
    assert d.window == 4 and d.autoscale == Autoscaling() and c.window == 2
    assert c.with_settings(autoscale=False).autoscale is None
    with pytest.raises(ValueError, match="unknown serving settings"):
        c.with_settings(windows=3)


def test_the_window_follows_the_bytes_in_flight_bound() -> None:
    c = ServeConfig()
    assert c.bytes_in_flight == DEFAULT_BYTES_IN_FLIGHT == 8 * 1024 * 1024
    assert c.constructor_bytes == DEFAULT_CONSTRUCTOR_BYTES == 16 * 1024 * 1024
    per_step = step_bytes(4096, 1)  # a thin block: input_ids only, int32[4096]
    assert per_step == 4 * 4096
    assert c.steps_ahead(per_step) == MAX_STEPS_AHEAD == 512  # 512 steps fit 8 MiB
    assert c.steps_ahead(step_bytes(8192, 8)) == 8 * 1024 * 1024 // (8 * 8192 * 4) == 32
    assert c.steps_ahead(step_bytes(65536, 64)) == 2  # a step larger than the bound: the window stays
    assert ServeConfig(bytes_in_flight=0, window=3).steps_ahead(per_step) == 3
    widened = c.for_plan(8192, 8)
    assert widened.window == 32 and widened.bytes_in_flight == c.bytes_in_flight and c.window == 2
    assert widened.for_plan(8192, 8) == widened  # idempotent: the Executor may apply it to a widened config
    with pytest.raises(ValueError, match="step_bytes"):
        c.steps_ahead(0)
    with pytest.raises(ValueError, match="ranks"):
        c.steps_ahead(per_step, 0)


def test_ranks_sharing_a_constructor_share_its_bytes() -> None:
    """16 MiB a constructor: 1 or 2 ranks of 4096 tokens get 512 steps each (8 MiB a rank), 4 ranks 256, 16 ranks 64,
    and more ranks never fewer than 64 each (SHARED_FLOOR_STEPS: fewer would mean more calls a step); more
    constructors give each rank more of it; the least `window` stays whatever the bounds say."""
    c = ServeConfig()
    assert SHARED_FLOOR_STEPS == 64
    assert [c.for_plan(4096, 1, dp).window for dp in (1, 2, 4, 16, 64, 256)] == [512, 512, 256, 64, 64, 64]
    assert c.for_plan(8192, 8, 64).window == 32  # the per-rank bound still holds under the floor
    assert c.with_settings(constructors=4).for_plan(4096, 1, 16).window == 256  # 4 ranks each
    assert c.with_settings(constructors=3).for_plan(4096, 1, 16).window == 16 * 1024 * 1024 // (6 * 4 * 4096)
    assert c.with_settings(constructors=64).for_plan(4096, 1, 16).window == 512  # one rank each, no empty group
    assert c.with_settings(constructor_bytes=0, window=5).for_plan(4096, 1, 16).window == 5
    with pytest.raises(ValueError, match="constructor_bytes"):
        ServeConfig(constructor_bytes=-1)


def test_a_long_lane_or_images_narrow_the_window() -> None:
    """A step counts one micro-batch at the long lane's length; a plan with images at three arrays a token (its
    groups are held as whole batches, pixels uncounted) and at most SHARED_FLOOR_STEPS steps, as before session 21."""
    c = ServeConfig()
    assert c.for_plan(4096, 1, 1, long_seq_len=131072).window == c.for_plan(131072, 1, 1).window == 16
    step = 4 * (7 * 4096 + 131072)  # 8 micro-batches, one of them at the long lane's length
    assert c.for_plan(4096, 8, 1, long_seq_len=131072).window == 8 * 1024 * 1024 // step == 13
    assert c.for_plan(4096, 1, 1, long_seq_len=None).window == 512
    with_images = c.for_plan(4096, 1, 1, images=True)
    assert with_images.window == SHARED_FLOOR_STEPS
    assert with_images.for_plan(4096, 1, 1, images=True) == with_images  # idempotent
    assert c.for_plan(65536, 8, 1, images=True).window == c.window  # a step over the bound: the least window


def test_no_worker_processes_is_a_layout() -> None:
    assert ServeConfig(n_workers=0).n_workers == 0  # the worker runs inside the serving process

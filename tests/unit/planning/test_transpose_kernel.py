"""The tiled transpose gives NumPy's transposed copy bit for bit, for the grids' dtypes and odd shapes."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning._transpose_kernel import transpose_into, transposed


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint32, np.uint16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 700), (130, 129), (20_001, 3), (257, 300)])
def test_transposed_is_numpys_transposed_copy(dtype: type, shape: tuple[int, int]) -> None:
    a = (np.random.default_rng(shape[0]).random(shape) * 60_000).astype(dtype)
    if dtype is np.float64:
        a[0, 0] = -0.0  # a signed zero survives as its own bits
    got = transposed(a)
    assert got.dtype == a.dtype and got.shape == shape[::-1] and got.flags.c_contiguous
    assert got.tobytes() == np.ascontiguousarray(a.T).tobytes()


def test_transposed_takes_views_and_refuses_other_dimensions() -> None:
    a = np.arange(300 * 200, dtype=np.int64).reshape(300, 200)
    view = a[::2, 5:]  # not contiguous
    assert transposed(view).tobytes() == np.ascontiguousarray(view.T).tobytes()
    with pytest.raises(ValueError, match="2-d array, got 1 dimensions"):
        transposed(np.zeros(5))


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
@pytest.mark.parametrize("shape", [(3, 5), (4096, 300), (70, 1)])
def test_transpose_into_fills_a_strided_view(dtype: type, shape: tuple[int, int]) -> None:
    """A block of steps into the columns first..first+n of a source-major grid: only that view changes."""
    rng = np.random.default_rng(shape[0])
    a = (rng.random(shape) * 60_000).astype(dtype)
    grid = np.full((shape[1], shape[0] + 20), 7, dtype=dtype)
    transpose_into(a, grid[:, 9 : 9 + shape[0]])
    assert grid[:, 9 : 9 + shape[0]].tobytes() == np.ascontiguousarray(a.T).tobytes()
    assert (grid[:, :9] == 7).all() and (grid[:, 9 + shape[0] :] == 7).all()
    with pytest.raises(ValueError, match="transpose_into"):
        transpose_into(a, grid[:, : shape[0] + 1])

"""Image token counts on hand-computed cases; decoded pixels always fill exactly the counted patches."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec
from loomdata.sources.images import decode_image, decoded_image_tokens, image_tokens, image_tokens_array, resized_size

SPEC = ImageSpec(patch_size=14, max_pixels=200_704)  # 1024 patches of 14x14


# (width, height) -> (tokens, resized width, resized height), worked out by hand from the rule.
HAND = {
    (28, 28): (4, 28, 28),  # exact multiple, under the budget: unchanged
    (100, 50): (32, 112, 56),  # ceil(100/14)=8, ceil(50/14)=4
    (1, 1): (1, 14, 14),  # at least one patch
    (448, 448): (1024, 448, 448),  # exactly the budget
    (447, 447): (1024, 448, 448),  # ceil to 32x32 = 1024 patches = the budget: allowed
    # 450*445 = 200250 <= budget, but ceil gives 33x32 = 1056 patches > 1024: floor to 32x31.
    (450, 445): (992, 448, 434),
    # 640x480 > budget: s = sqrt(200704/307200) = 0.80829; 36.95 x 27.71 patches;
    # ceil 37x28 = 1036 > 1024, so floor 36x27 = 972.
    (640, 480): (972, 504, 378),
    (4000, 3000): (972, 504, 378),  # same aspect ratio, same result: never depends on the scale
    # 1000*200 = 200000 <= budget, s = 1; ceil 72x15 = 1080 > 1024 patches: floor 71x14.
    (1000, 200): (994, 994, 196),
}


@pytest.mark.parametrize(("size", "want"), list(HAND.items()))
def test_hand_computed_cases(size: tuple[int, int], want: tuple[int, int, int]) -> None:
    w, h = size
    tokens, rw, rh = want
    assert image_tokens(w, h, SPEC) == tokens
    assert resized_size(w, h, SPEC) == (rw, rh)
    assert tokens == (rw // 14) * (rh // 14)
    assert image_tokens(h, w, SPEC) == tokens  # symmetric in width and height


def test_other_patch_size_and_budget() -> None:
    spec = ImageSpec(patch_size=16, max_pixels=256 * 256)
    # s = 256/1440: 21.33 x 12 patches -> ceil 22x12 = 264 > 256 -> floor 21x12
    assert image_tokens(1920, 1080, spec) == 252
    assert image_tokens(64, 33, spec) == 12  # 4 x ceil(2.06) = 4 x 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6000), st.integers(1, 6000)), min_size=1, max_size=50))
def test_vectorised_equals_scalar_and_stays_in_budget(sizes: list[tuple[int, int]]) -> None:
    w = np.array([s[0] for s in sizes])
    h = np.array([s[1] for s in sizes])
    arr = image_tokens_array(w, h, SPEC)
    assert arr.dtype == np.uint32
    assert arr.tolist() == [image_tokens(a, b, SPEC) for a, b in sizes]
    for (a, b), t in zip(sizes, arr.tolist(), strict=True):
        rw, rh = resized_size(a, b, SPEC)
        if rw > 14 and rh > 14:  # very thin images keep one patch on their short side
            assert rw * rh <= SPEC.max_pixels
        if a * b <= SPEC.max_pixels and (a % 14 == 0 and b % 14 == 0):
            assert (rw, rh) == (a, b)  # never resized when already fitting
        assert t == (rw // 14) * (rh // 14) >= 1


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1 pixel"):
        image_tokens(0, 10, SPEC)
    with pytest.raises(ValueError, match="differ in shape"):
        image_tokens_array(np.array([1, 2]), np.array([1]), SPEC)
    assert image_tokens_array(np.array([], dtype=np.int64), np.array([], dtype=np.int64), SPEC).tolist() == []


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
@pytest.mark.parametrize(("w", "h"), [(640, 480), (37, 91), (1200, 300), (14, 14)])
def test_decoded_pixels_fill_the_counted_patches(fmt: str, w: int, h: int) -> None:
    img = Image.new("RGB", (w, h), (200, 40, 90))
    arr = decode_image(encode(img, fmt), SPEC)
    rw, rh = resized_size(w, h, SPEC)
    assert arr.shape == (rh, rw, 3)
    assert arr.dtype == np.uint8
    assert decoded_image_tokens(arr, SPEC.patch_size) == image_tokens(w, h, SPEC)
    # the colour survives decoding and resizing (JPEG is lossy: a small tolerance)
    assert np.abs(arr.reshape(-1, 3).mean(axis=0) - [200, 40, 90]).max() < 4


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16", "1"])
def test_any_mode_becomes_rgb(mode: str) -> None:
    img = Image.new(mode, (30, 20))
    arr = decode_image(encode(img, "PNG"), SPEC)
    assert arr.shape == (28, 42, 3)


def test_decoding_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    data = encode(Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)), "JPEG")
    np.testing.assert_array_equal(decode_image(data, SPEC), decode_image(data, SPEC))


def test_undecodable_images_raise_source_data_error() -> None:
    with pytest.raises(SourceDataError, match=r"shard\.tar:k\.jpg: cannot decode image \(UnidentifiedImageError"):
        decode_image(b"not an image at all", SPEC, name="shard.tar:k.jpg")
    good = encode(Image.new("RGB", (300, 200), (1, 2, 3)), "PNG")
    with pytest.raises(SourceDataError, match="cannot decode image"):
        decode_image(good[: len(good) // 2], SPEC)

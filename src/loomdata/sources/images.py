"""Image sizing, token counts and decoding, one rule shared by the index scan and the loaders.

The rule (in the spirit of Qwen2-VL's "smart resize"), for an image of `w x h` pixels, patch `p`
and budget `max_pixels` (both from `ImageSpec`):

1. scale `s = min(1, sqrt(max_pixels / (w * h)))`: shrink to the pixel budget keeping the aspect
   ratio, never enlarge;
2. patch grid `gw = ceil(w * s / p)`, `gh = ceil(h * s / p)`: each side is rounded UP to whole
   patches, so no content is cropped and every image has at least one patch;
3. if rounding up broke the budget (`gw * gh * p * p > max_pixels`), round both sides DOWN instead:
   `gw = max(1, floor(w * s / p))`, `gh = max(1, floor(h * s / p))`.

The image is resized to `(gw * p) x (gh * p)` pixels and costs `gw * gh` tokens. The result stays
within `max_pixels` except for images so thin that one side keeps its single patch. Sizes come from
the image header only (no EXIF rotation is applied anywhere), so the scan counts exactly the tokens
`decode_image`'s pixels fill; `decoded_image_tokens` reads that count back from a decoded image (the
readers and the loaders use it, so the rule is written once).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

from loomdata.schemas.errors import SourceDataError

if TYPE_CHECKING:  # annotations only: a serving worker reads records, not the pydantic spec
    from loomdata.schemas.records import AnyImages

__all__ = [
    "decode_image",
    "decoded_image_tokens",
    "image_grid_array",
    "image_tokens",
    "image_tokens_array",
    "resized_size",
]


def image_grid_array(widths: np.ndarray, heights: np.ndarray, spec: AnyImages) -> tuple[np.ndarray, np.ndarray]:
    """Patch grid (columns, rows) per image, as int64 arrays, by the module's resize rule."""
    w = np.asarray(widths, dtype=np.int64)
    h = np.asarray(heights, dtype=np.int64)
    if w.shape != h.shape:
        raise ValueError(f"widths and heights differ in shape: {w.shape} vs {h.shape}")
    if w.size and (w.min() < 1 or h.min() < 1):
        raise ValueError("image sides must be >= 1 pixel")
    p = spec.patch_size
    pixels = (w * h).astype(np.float64)
    # s == 1 within the budget; then w / p is exact, so ceil/floor below are exact integers too.
    s = np.where(pixels > spec.max_pixels, np.sqrt(spec.max_pixels / np.maximum(pixels, 1.0)), 1.0)
    sw = w * s / p
    sh = h * s / p
    up_w = np.maximum(np.ceil(sw).astype(np.int64), 1)
    up_h = np.maximum(np.ceil(sh).astype(np.int64), 1)
    over = up_w * up_h * (p * p) > spec.max_pixels
    gw = np.where(over, np.maximum(np.floor(sw).astype(np.int64), 1), up_w)
    gh = np.where(over, np.maximum(np.floor(sh).astype(np.int64), 1), up_h)
    return gw, gh


def image_tokens_array(widths: np.ndarray, heights: np.ndarray, spec: AnyImages) -> np.ndarray:
    """uint32 token counts of many images at once (vectorised `image_tokens`)."""
    gw, gh = image_grid_array(widths, heights, spec)
    return (gw * gh).astype(np.uint32)


def image_tokens(width: int, height: int, spec: AnyImages) -> int:
    """Tokens (patches) an image of `width x height` pixels costs after resizing."""
    return int(image_tokens_array(np.array([width]), np.array([height]), spec)[0])


def resized_size(width: int, height: int, spec: AnyImages) -> tuple[int, int]:
    """(width, height) in pixels an image is resized to: whole patches, per the module's rule."""
    gw, gh = image_grid_array(np.array([width]), np.array([height]), spec)
    return int(gw[0]) * spec.patch_size, int(gh[0]) * spec.patch_size


def decoded_image_tokens(image: np.ndarray, patch_size: int) -> int:
    """Tokens a decoded image (HWC, sized by `decode_image`) stands for: one per whole patch of its pixels.

    Equals `image_tokens` of the image's original size: `decode_image` resizes to whole patches.
    """
    return (int(image.shape[0]) // patch_size) * (int(image.shape[1]) // patch_size)


def decode_image(data: bytes, spec: AnyImages, *, name: str = "<image bytes>") -> np.ndarray:
    """Decode `data` to an HWC uint8 RGB array resized to `resized_size` (so pixels match tokens).

    `name` (file and member) goes into the SourceDataError raised for undecodable data.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            size = resized_size(im.width, im.height, spec)
            im.draft("RGB", size)  # JPEG: decode at a reduced scale when far larger than needed
            rgb = im.convert("RGB")
        if rgb.size != size:
            rgb = rgb.resize(size, Image.Resampling.BICUBIC)
        return np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise SourceDataError(
            name,
            f"cannot decode image ({type(e).__name__}: {e})",
            hint="replace the image, or set `on_error: skip` and re-index to leave the sample out",
        ) from None

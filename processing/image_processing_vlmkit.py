"""Image processor: any image input -> Qwen3-VL patches, without torchvision.

Pipeline per image (identical numbers to transformers' Qwen2VLImageProcessorPil set up as
Qwen3-VL's): load (PIL, numpy, torch, path, bytes) -> EXIF orientation -> RGB (transparency
composited on white, 16-bit scaled to 8-bit) -> smart resize with PIL bicubic -> rescale and
normalise -> patchify in merge-block order (reordering uint8 before converting), the image repeated over
the temporal patch. Only the resize is per image; everything else is a handful of numpy calls.
"""

import io
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ImagesKwargs
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Qwen3-VL preprocessor_config.json values (the class defaults of transformers are Qwen2-VL's)
QWEN3_VL_IMAGE_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}
HALF = [0.5, 0.5, 0.5]
MAX_ASPECT_RATIO = 200


class VLMKitImagesKwargs(ImagesKwargs, total=False):
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2/3-VL target size: sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. Python's round() is half-to-even (720/32 -> 22)."""
    if min(height, width) <= 0:
        raise ValueError(f"image has zero size ({height}x{width})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {height}x{width} has aspect ratio {max(height, width) / min(height, width):.1f}; "
            f"at most {MAX_ASPECT_RATIO} is supported"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _array_to_pil(array: np.ndarray) -> Image.Image:
    """(H, W), (H, W, C) or (C, H, W) array of uint8, 16-bit ints or floats in [0, 1] -> PIL image."""
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)  # (C, H, W) -> (H, W, C)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(f"cannot read an image from an array of shape {array.shape}; expected (H, W), (H, W, C) or (C, H, W)")
    if array.size == 0:
        raise ValueError(f"image array of shape {array.shape} is empty")
    if np.issubdtype(array.dtype, np.floating):
        # floats are taken as [0, 1] intensities (as after ToTensor) unless they exceed 1
        scale = 255.0 if float(np.nanmax(array)) <= 1.0 else 1.0
        array = np.clip(np.rint(array * scale), 0, 255).astype(np.uint8)
    elif array.dtype == np.uint16 or (array.dtype.kind in "iu" and array.max(initial=0) > 255):
        array = (array.astype(np.uint32) // 257).astype(np.uint8)  # 16-bit -> 8-bit, 65535 -> 255
    else:
        array = array.astype(np.uint8)
    return Image.fromarray(array)


def load_image(image: Any) -> Image.Image:
    """PIL image from a PIL image, numpy array, torch tensor, file path or raw bytes."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _open_image_bytes(bytes(image), "image bytes")
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        if path.startswith(("http://", "https://")):
            raise ValueError(f"vlmkit does not download images; fetch {path} yourself and pass the image or its bytes")
        if not os.path.isfile(path):
            raise ValueError(f"image file {path!r} does not exist")
        with open(path, "rb") as handle:
            return _open_image_bytes(handle.read(), path)
    if hasattr(image, "detach") and hasattr(image, "cpu"):  # torch tensor, without importing torch here
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        return _array_to_pil(image)
    raise TypeError(f"unsupported image type {type(image).__name__}; pass a PIL image, array, tensor, path or bytes")


def _open_image_bytes(data: bytes, source: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now, so truncated files fail here rather than later
    except UnidentifiedImageError as err:
        raise ValueError(f"cannot decode {source} ({len(data)} bytes): not a recognised image format") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"cannot decode {source} ({len(data)} bytes): {err}") from err
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with EXIF orientation applied, transparency composited on white, high bit depths scaled."""
    image = ImageOps.exif_transpose(image)
    if image.width == 0 or image.height == 0:
        raise ValueError(f"image has zero size ({image.height}x{image.width})")
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # PIL's own convert() clips these to 255; scale the full range instead
        array = np.asarray(image)
        if image.mode == "F":
            array = array / max(float(array.max()), 1e-12) if array.max() > 1 else array
        elif array.max(initial=0) > 255:
            array = array.astype(np.float64) / 65535.0
        image = _array_to_pil(np.asarray(array))
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def patchify(
    pixels: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int, normalise,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """(T, H, W, C) uint8 frames -> (gt*gh*gw, C*Tp*P*P) float32 patches.

    T is a multiple of temporal_patch_size, or 1 for an image, which is then repeated over the
    temporal patch. Rows run over (gt, gh/m, gw/m, m, m): block-major, so m*m consecutive rows form
    one merge window. Features run over (C, Tp, P, P), matching the Conv3d weight (D, C, Tp, P, P).
    The reorder happens on uint8 data (4x less memory to move); `normalise` maps the reordered uint8
    block to float32, written straight into `out` (gt*gh*gw, C*Tp*P*P) when given.
    """
    t, h, w, c = pixels.shape
    tp, p, m = temporal_patch_size, patch_size, merge_size
    frames = t if t == 1 else tp  # an image is one frame broadcast over Tp below
    gt, gh, gw = max(t // tp, 1), h // p, w // p
    x = pixels.reshape(gt, frames, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (gt, gh/m, gw/m, m, m, C, T, P, P)
    values = normalise(np.ascontiguousarray(x))
    if out is None:
        out = np.empty((gt * gh * gw, c * tp * p * p), dtype=np.float32)
    # broadcasts an image's single frame over the temporal patch
    out.reshape(gt, gh // m, gw // m, m, m, c, tp, p, p)[...] = values
    return out


def normaliser(rescale_factor: float, mean, std, do_rescale: bool, do_normalize: bool):
    """uint8 (..., C, T, P, P) -> float32, with transformers' arithmetic: rescale in float64, cast
    to float32, then (x - mean) / std in float32 (bit-identical to its numpy path), in place."""
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    if np.all(mean == mean[0]) and np.all(std == std[0]):
        mean, std = mean[0], std[0]  # scalar broadcasting is much faster than per-channel
    else:
        mean, std = mean.reshape(-1, 1, 1, 1), std.reshape(-1, 1, 1, 1)

    def apply(block: np.ndarray) -> np.ndarray:
        if do_rescale:
            wide = block.astype(np.float64)
            wide *= rescale_factor
            values = wide.astype(np.float32)
        else:
            values = block.astype(np.float32)
        if do_normalize:
            values -= mean
            values /= std
        return values

    return apply


def with_pixel_budget(size: dict, min_pixels: int | None, max_pixels: int | None) -> dict:
    """A copy of a `size` dict with `min_pixels` / `max_pixels` (aliases of its shortest / longest edge) applied."""
    size = dict(size)
    if min_pixels is not None:
        size["shortest_edge"] = min_pixels
    if max_pixels is not None:
        size["longest_edge"] = max_pixels
    return size


def pop_settings(defaults: dict, kwargs: dict) -> dict:
    """Take a processor's settings out of its constructor kwargs, with defaults; `min_pixels` and
    `max_pixels` are aliases of `size["shortest_edge"]` / `size["longest_edge"]`."""
    settings = {key: kwargs.pop(key, default) for key, default in defaults.items()}
    settings["size"] = with_pixel_budget(settings["size"], kwargs.pop("min_pixels", None), kwargs.pop("max_pixels", None))
    settings["resample"] = int(settings["resample"])
    settings["image_mean"], settings["image_std"] = list(settings["image_mean"]), list(settings["image_std"])
    return settings


class VLMKitImageProcessor(BaseImageProcessor):
    r"""Qwen3-VL image preprocessing in PIL + numpy.

    `size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}` is the per-image pixel budget
    (`min_pixels` / `max_pixels` are accepted as aliases). Returns `pixel_values`
    (patches, C*T*P*P) float32 and `image_grid_thw` (images, 3) int64.
    """

    model_input_names = ["pixel_values", "image_grid_thw"]
    valid_kwargs = VLMKitImagesKwargs
    defaults = dict(
        do_resize=True, size=QWEN3_VL_IMAGE_SIZE, resample=Image.Resampling.BICUBIC, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=HALF, image_std=HALF, do_convert_rgb=True,
        patch_size=16, temporal_patch_size=2, merge_size=2,
    )

    def __init__(self, **kwargs):
        kwargs.pop("image_processor_type", None)
        settings = pop_settings(self.defaults, kwargs)
        super().__init__(**kwargs)
        for key, value in settings.items():
            setattr(self, key, value)

    @property
    def min_pixels(self) -> int:
        return self.size["shortest_edge"]

    @property
    def max_pixels(self) -> int:
        return self.size["longest_edge"]

    def _settings(self, overrides: dict) -> dict:
        unknown = set(overrides) - set(self.defaults) - {"min_pixels", "max_pixels"}
        if unknown:
            raise TypeError(f"unknown image processor argument(s): {sorted(unknown)}")
        settings = {key: overrides.get(key, getattr(self, key)) for key in self.defaults}
        settings["size"] = with_pixel_budget(settings["size"], overrides.get("min_pixels"), overrides.get("max_pixels"))
        return settings

    def target_size(self, height: int, width: int, settings: dict | None = None) -> tuple[int, int]:
        settings = settings or self._settings({})
        factor = settings["patch_size"] * settings["merge_size"]
        return smart_resize(height, width, factor, settings["size"]["shortest_edge"], settings["size"]["longest_edge"])

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        settings = self._settings(dict(images_kwargs or {}))
        h, w = self.target_size(height, width, settings)
        return (h // settings["patch_size"]) * (w // settings["patch_size"])

    def prepare(self, image: Any, settings: dict) -> Image.Image:
        """Load, orient, convert and resize one image (the only per-image work)."""
        pil = load_image(image)
        pil = to_rgb(pil) if settings["do_convert_rgb"] else pil
        if settings["do_resize"]:
            h, w = self.target_size(pil.height, pil.width, settings)
            pil = pil.resize((w, h), resample=settings["resample"])
        return pil

    def __call__(self, images, return_tensors=None, **kwargs) -> BatchFeature:
        return self.preprocess(images, return_tensors=return_tensors, **kwargs)

    def preprocess(self, images, return_tensors=None, **kwargs) -> BatchFeature:
        images = _flatten_images(images)
        if not images:
            raise ValueError("no images were given")
        settings = self._settings(kwargs)
        normalise = normaliser(settings["rescale_factor"], settings["image_mean"], settings["image_std"],
                               settings["do_rescale"], settings["do_normalize"])
        p, m, tp = settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]
        # Decoding and resizing release the GIL inside PIL, and so do numpy's large array
        # operations: both phases run on a few threads, writing into one preallocated output.
        pixels = map_images(lambda image: np.asarray(self.prepare(image, settings), dtype=np.uint8), images)
        for array in pixels:
            if array.shape[0] % (p * m) or array.shape[1] % (p * m):
                raise ValueError(
                    f"with do_resize=False the image size {array.shape[:2]} must be a multiple of "
                    f"patch_size * merge_size = {p * m}"
                )
        grids = [[1, a.shape[0] // p, a.shape[1] // p] for a in pixels]
        offsets = np.cumsum([0] + [g[1] * g[2] for g in grids])
        pixel_values = np.empty((int(offsets[-1]), 3 * tp * p * p), dtype=np.float32)
        map_images(
            lambda i: patchify(pixels[i][None], p, m, tp, normalise, out=pixel_values[offsets[i]:offsets[i + 1]]),
            list(range(len(pixels))),
        )
        data = {"pixel_values": pixel_values, "image_grid_thw": np.asarray(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)


def map_images(fn, items: list) -> list:
    """fn over items, on a few threads when there are several (PIL releases the GIL)."""
    workers = min(len(items), os.cpu_count() or 1, 8)
    if workers < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def _flatten_images(images) -> list:
    """One image, a list of images, or a per-sample list of lists -> flat list."""
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        flat = []
        for item in images:
            flat.extend(_flatten_images(item) if isinstance(item, (list, tuple)) else [item])
        return flat
    return [images]

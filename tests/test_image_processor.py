"""VLMKitImageProcessor against transformers' Qwen2VLImageProcessorPil set up as Qwen3-VL's."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmkit import VLMKitImageProcessor
from vlmkit.processing.image_processing_vlmkit import load_image, to_rgb

QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                size={"shortest_edge": 65536, "longest_edge": 16777216})
SIZES = [  # (height, width)
    (256, 256), (1, 64), (64, 1), (10, 100), (100, 10), (720, 1280), (1080, 1920), (480, 640), (100, 100),
    (48, 80), (33, 47), (511, 513), (300, 30), (1, 1), (17, 3000), (6000, 8000), (224, 224), (999, 333),
    (2048, 64), (65, 97),
]


def _random_image(h, w, seed):
    """Random pixels upscaled with NEAREST, so even 8000x6000 is cheap to build."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.NEAREST)


def test_twenty_sizes_match_the_reference_processor():
    reference, ours = Qwen2VLImageProcessorPil(**QWEN3_VL), VLMKitImageProcessor()
    assert len(SIZES) == 20
    for seed, (h, w) in enumerate(SIZES):
        image = _random_image(h, w, seed)
        expected, got = reference(image, return_tensors="np"), ours(image, return_tensors="np")
        assert np.array_equal(expected["image_grid_thw"], got["image_grid_thw"]), (h, w)
        assert got["pixel_values"].dtype == np.float32
        assert np.abs(expected["pixel_values"] - got["pixel_values"]).max() <= 1e-6, (h, w)


def test_huge_image_stays_within_the_pixel_budget():
    ours = VLMKitImageProcessor()
    grid = ours(_random_image(6000, 8000, 0))["image_grid_thw"][0]
    assert grid[1] * grid[2] * 16 * 16 <= ours.max_pixels
    assert grid[1] * grid[2] // 4 <= ours.max_pixels // (32 * 32)  # tokens
    assert abs(grid[2] / grid[1] - 8000 / 6000) < 0.02  # aspect ratio kept


def test_round_half_to_even_and_budget_overrides():
    ours = VLMKitImageProcessor()
    assert ours.target_size(720, 1280) == (704, 1280)  # round(22.5) == 22
    small = ours(_random_image(720, 1280, 1), max_pixels=256 * 256)["image_grid_thw"][0]
    assert small[1] * small[2] * 256 <= 256 * 256


def test_every_input_type_gives_the_same_pixels(tmp_path):
    image = _random_image(40, 60, 3)
    ours = VLMKitImageProcessor(patch_size=4, size={"shortest_edge": 64, "longest_edge": 4096})
    expected = ours(image)["pixel_values"]
    array = np.array(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path = tmp_path / "image.png"
    path.write_bytes(buffer.getvalue())
    inputs = [array, array.transpose(2, 0, 1), torch.from_numpy(array), torch.from_numpy(array).permute(2, 0, 1),
              str(path), path, buffer.getvalue(), array.astype(np.float32) / 255.0]
    for item in inputs:
        assert np.array_equal(ours(item)["pixel_values"], expected), type(item)


def _pixel(image):
    return tuple(np.asarray(to_rgb(image))[0, 0].tolist())


def test_every_mode_converts_to_rgb_correctly():
    assert _pixel(Image.new("RGBA", (2, 2), (255, 0, 0, 0))) == (255, 255, 255)  # transparent -> white
    assert _pixel(Image.new("RGBA", (2, 2), (255, 0, 0, 255))) == (255, 0, 0)
    assert _pixel(Image.new("RGBA", (2, 2), (0, 0, 0, 128))) == (127, 127, 127)
    assert _pixel(Image.new("LA", (2, 2), (0, 0))) == (255, 255, 255)
    assert _pixel(Image.new("L", (2, 2), 77)) == (77, 77, 77)
    palette = Image.new("P", (2, 2), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    assert _pixel(palette) == (10, 200, 30)
    assert _pixel(Image.new("CMYK", (2, 2), (0, 255, 255, 0))) == (255, 0, 0)
    assert _pixel(Image.new("CMYK", (2, 2), (0, 0, 0, 255))) == (0, 0, 0)
    deep = Image.fromarray(np.full((2, 2), 65535, dtype=np.uint16))
    assert deep.mode.startswith("I")
    assert _pixel(deep) == (255, 255, 255)  # PIL's own convert() would clip the scale differently
    half = Image.fromarray(np.full((2, 2), 32896, dtype=np.uint16))
    assert _pixel(half) == (128, 128, 128)
    # and through the processor: (128 / 255 - 0.5) / 0.5
    ours = VLMKitImageProcessor(patch_size=4, size={"shortest_edge": 16, "longest_edge": 4096})
    values = ours(Image.fromarray(np.full((8, 8), 32896, dtype=np.uint16)), do_resize=False)["pixel_values"]
    assert np.allclose(values, (128 / 255 - 0.5) / 0.5, atol=1e-6)


def test_exif_orientation_is_applied():
    image = _random_image(24, 40, 5)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif.tobytes())
    ours = VLMKitImageProcessor(patch_size=4, size={"shortest_edge": 16, "longest_edge": 4096})
    rotated = ours(buffer.getvalue())
    expected = ours(image.transpose(Image.Transpose.ROTATE_270))
    assert rotated["image_grid_thw"].tolist() == [[1, 10, 6]]
    assert np.array_equal(rotated["pixel_values"], expected["pixel_values"])


def test_bad_images_raise_clear_errors():
    with pytest.raises(ValueError, match=r"cannot decode image bytes \(12 bytes\): not a recognised image format"):
        load_image(b"not-an-image")
    buffer = io.BytesIO()
    _random_image(64, 64, 0).save(buffer, format="JPEG")
    with pytest.raises(ValueError, match="cannot decode image bytes"):
        load_image(buffer.getvalue()[:200])
    ours = VLMKitImageProcessor()
    with pytest.raises(ValueError, match=r"zero size \(0x5\)"):
        ours(Image.new("RGB", (5, 0)))
    with pytest.raises(ValueError, match=r"empty"):
        ours(np.zeros((0, 5, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="aspect ratio 250.0; at most 200"):
        ours(Image.new("RGB", (500, 2)))
    with pytest.raises(ValueError, match="does not exist"):
        ours("/nonexistent/image.png")

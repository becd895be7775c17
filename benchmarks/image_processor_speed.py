"""Image preprocessing speed: vlmkit's VLMKitImageProcessor against transformers'
Qwen2VLImageProcessorPil (set up as Qwen3-VL's), side by side in one process, same images.

    python benchmarks/image_processor_speed.py [--batch 32] [--repeats 7]

Prints the median time per batch of each, their ratio, and the largest output difference (the
outputs must be identical). Two batches: images of exactly 256x256 (no resize needed) and of about
256x256 (240-271 px sides, so every image is resized with PIL bicubic by both).
"""

import argparse
import statistics
import time

import numpy as np
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlmkit import VLMKitImageProcessor

QWEN3_VL = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                size={"shortest_edge": 65536, "longest_edge": 16777216})


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    reference, ours = Qwen2VLImageProcessorPil(**QWEN3_VL), VLMKitImageProcessor()
    batches = {
        "exactly 256x256": [(256, 256)] * args.batch,
        "about 256x256": [tuple(rng.integers(240, 272, 2)) for _ in range(args.batch)],
    }
    print(f"| images ({args.batch} per batch) | Qwen2VLImageProcessorPil | VLMKitImageProcessor | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    for name, sizes in batches.items():
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        expected, got = reference(images, return_tensors="np"), ours(images, return_tensors="np")
        assert np.array_equal(expected["image_grid_thw"], got["image_grid_thw"])
        diff = float(np.abs(expected["pixel_values"] - got["pixel_values"]).max())
        t_ref = median_seconds(lambda: reference(images, return_tensors="np"), args.repeats)
        t_ours = median_seconds(lambda: ours(images, return_tensors="np"), args.repeats)
        print(f"| {name} | {t_ref * 1000:.1f} ms | {t_ours * 1000:.1f} ms | {t_ref / t_ours:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()

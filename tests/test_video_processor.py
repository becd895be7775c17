"""Video processing: frame counts, padding, sampling, budgets and timestamps."""

import math

import numpy as np
import pytest
from PIL import Image

from vlmkit import VLMKitVideoProcessor
from vlmkit.processing import frame_timestamps


def _frames(n, h=24, w=32, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def _small():
    return VLMKitVideoProcessor(patch_size=4, size={"shortest_edge": 64, "longest_edge": 8 * 4096})


@pytest.mark.parametrize("n", range(1, 10))
def test_frame_counts_pad_to_the_temporal_patch(n, tiny_processor):
    out = _small()(_frames(n), video_metadata={"fps": 2.0})
    t, h, w = out["video_grid_thw"][0].tolist()
    assert t == math.ceil(n / 2)
    assert out["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 4 * 4)
    # odd counts repeat the last frame: the second half of the last temporal patch equals the first
    if n % 2:
        last = out["pixel_values_videos"][-h * w:].reshape(h * w, 3, 2, 16)
        assert np.array_equal(last[:, :, 0], last[:, :, 1])
    # the processor writes exactly as many placeholders as the geometry says the model will emit
    text = "<|vision_start|><|video_pad|><|vision_end|>what moves?"
    enc = tiny_processor(text=text, videos=[_frames(n)], video_metadata={"fps": 2.0})
    assert sum(row.count(2) for row in enc["mm_token_type_ids"]) == t * h * w // 4


@pytest.mark.parametrize("fps", [1, 2, 4, 8])
def test_timestamps_equal_their_analytic_values(fps, tiny_processor):
    frames = _frames(8)
    enc = tiny_processor(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[frames], video_metadata={"fps": fps})
    decoded = tiny_processor.tokenizer.decode(enc["input_ids"][0])
    expected = [(2 * k + 2 * k + 1) / 2 / fps for k in range(4)]  # mean of each pair of frame times
    assert frame_timestamps(list(range(8)), fps, 2) == expected
    stamps = [f"<{s:.1f} seconds>" for s in expected]
    assert [decoded.index(s) for s in stamps] == sorted(decoded.index(s) for s in stamps)
    assert len(set(stamps)) == 4  # never collapse to equal values
    assert enc["video_grid_thw"][0][0] == 4


def test_sampling_by_fps_and_num_frames():
    video = np.random.default_rng(0).integers(0, 256, (48, 24, 32, 3), dtype=np.uint8)
    processor = _small()
    by_fps = processor(video, video_metadata={"fps": 24.0}, fps=2)["video_metadata"][0]
    assert by_fps.frames_indices == [0, 16, 31, 47]  # int(48 / 24 * 2) = 4 frames, linspace(0, 47).round()
    by_count = processor(video, num_frames=6)["video_metadata"][0]
    assert by_count.frames_indices == np.linspace(0, 47, 6).round().astype(int).tolist()
    as_given = processor(list(video[:5]), video_metadata={"fps": 10.0})["video_metadata"][0]
    assert as_given.frames_indices == [0, 1, 2, 3, 4] and as_given.fps == 10.0
    with pytest.raises(ValueError, match="mutually exclusive"):
        processor(video, fps=2, num_frames=4)


def test_total_pixel_budget_holds_over_all_frames():
    budget = 64 * 32 * 32
    processor = VLMKitVideoProcessor(size={"shortest_edge": 4 * 32 * 32, "longest_edge": budget})
    frames = _frames(64, h=480, w=640)
    out = processor(frames, video_metadata={"fps": 8.0})
    t, h, w = out["video_grid_thw"][0].tolist()
    assert t == 32 and 2 * t * h * w * 16 * 16 <= budget
    assert abs(w / h - 640 / 480) < 0.5


def test_bad_videos_raise_clear_errors():
    processor = _small()
    with pytest.raises(ValueError, match="zero frames"):
        processor(np.zeros((0, 8, 8, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\(T, H, W, C\)"):
        processor(np.zeros((8, 8, 3, 3, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="frames differ in size"):
        processor(_frames(2) + _frames(2, h=30))

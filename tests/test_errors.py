"""Bad input gets a ValueError that names the numbers."""

import pytest
import torch
from helpers import batch_inputs, sample


def test_placeholders_versus_features(pair):
    _, ours = pair
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(4)])
    ids = inputs["input_ids"].clone()
    ids[0, -1] = 251  # one extra image placeholder
    with pytest.raises(ValueError, match=r"input holds 7 image tokens but the 1 image\(s\) give 6 features"):
        ours(**{**inputs, "input_ids": ids, "mm_token_type_ids": None})


def test_placeholders_without_pixels(pair):
    _, ours = pair
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(4)])
    with pytest.raises(ValueError, match="input holds 6 image placeholder tokens but no image pixels"):
        ours(input_ids=inputs["input_ids"])


def test_pixel_values_without_a_grid(pair):
    _, ours = pair
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(4)])
    with pytest.raises(ValueError, match=r"pixel_values of shape \(24, 96\) were given without image_grid_thw"):
        ours(**{**inputs, "image_grid_thw": None})
    videos = batch_inputs([sample(4).text(3).video(2, 4, 4).text(4)])
    with pytest.raises(ValueError, match=r"pixel_values_videos of shape \(32, 96\) were given without video_grid_thw"):
        ours(**{**videos, "video_grid_thw": None})


def test_grid_not_divisible_by_the_merge_size(pair):
    _, ours = pair
    with pytest.raises(ValueError, match=r"image_grid_thw\[1\] = \(t=1, h=3, w=4\).*multiples of spatial_merge_size 2"):
        ours.model.get_image_features(torch.randn(24, 96), torch.tensor([[1, 2, 6], [1, 3, 4]]))


def test_pixel_rows_that_do_not_match_the_grid(pair):
    _, ours = pair
    with pytest.raises(ValueError, match=r"pixel_values has 20 patch rows but the grids \[\[1, 4, 6\]\] describe 24"):
        ours.model.get_image_features(torch.randn(20, 96), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match=r"must have shape \(num_patches, 96\)"):
        ours.model.get_image_features(torch.randn(24, 95), torch.tensor([[1, 4, 6]]))

"""Vision tower: segment-confined attention, its memory bound, and the geometry tables."""

import torch
import torch.nn.functional as F
from helpers import PATCH_WIDTH
from transformers import AttentionInterface

from vlmkit.modeling.vision_geometry import patch_coordinates, position_table_taps

SCORE_SIZES: list[int] = []


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    """Records the size of the score tensor an eager kernel would build, then runs sdpa."""
    SCORE_SIZES.append(query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2])
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("vlmkit_score_probe", _probe_attention)


def test_largest_score_tensor_is_bounded_by_the_largest_single_image_or_slice(pair):
    _, ours = pair
    visual = ours.model.visual
    grids = torch.tensor([[1, 4, 6], [1, 8, 8], [1, 2, 10], [3, 6, 6]])  # images of 24, 64, 20 and a 3-slice video
    pixels = torch.randn(int(grids.prod(-1).sum()), PATCH_WIDTH)
    with torch.no_grad():
        expected = visual(pixels, grids).pooler_output
        visual.config._attn_implementation = "vlmkit_score_probe"
        SCORE_SIZES.clear()
        got = visual(pixels, grids).pooler_output
    heads, depth = visual.config.num_heads, visual.config.depth
    assert torch.allclose(expected, got, atol=1e-6)
    # one kernel call per image and per temporal slice, in every block
    assert len(SCORE_SIZES) == depth * (3 + 3)
    assert max(SCORE_SIZES) == heads * 64 * 64
    total = int(grids.prod(-1).sum())
    assert max(SCORE_SIZES) * 10 < heads * total * total


def test_attention_never_crosses_images_or_video_slices(pair):
    _, ours = pair
    visual = ours.model.visual
    grids = torch.tensor([[1, 4, 4], [2, 4, 4]])
    pixels = torch.randn(48, PATCH_WIDTH)
    with torch.no_grad():
        together = visual(pixels, grids).last_hidden_state
        image = visual(pixels[:16], grids[:1]).last_hidden_state
        changed = pixels.clone()
        changed[32:] += 1.0  # second slice of the video
        other = visual(changed, grids).last_hidden_state
    assert torch.allclose(together[:16], image, atol=1e-6)
    assert torch.equal(together[:32], other[:32])  # image and the video's first slice untouched
    assert not torch.allclose(together[32:], other[32:])


def test_position_table_taps_equal_bilinear_interpolation_in_block_order():
    side, dim = 7, 5
    table = torch.randn(side * side, dim, dtype=torch.float64)
    for t, h, w in [(1, 4, 6), (2, 2, 10), (1, 12, 2)]:
        idx, wts = position_table_taps(torch.tensor([[t, h, w]]), side, 2)
        got = (table[idx] * wts[..., None].double()).sum(1)
        grid = table.T.reshape(1, dim, side, side)
        dense = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)  # (h, w, D)
        block = dense.reshape(h // 2, 2, w // 2, 2, dim).transpose(1, 2).reshape(h * w, dim).repeat(t, 1)
        assert (got - block).abs().max().item() < 1e-6


def test_patch_coordinates_are_block_major():
    coords = patch_coordinates(torch.tensor([[1, 4, 4]]), 2)
    assert coords[:, 0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert coords[:, 1].tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 0, 1, 0, 1, 2, 3, 2, 3]

"""Batching, token counts and the cache, for every connector (issue 4 done-when items 1, 2 and 4)."""

import random

import torch
from helpers import PATCH_WIDTH, batch_inputs, sample

from vlmkit.configuration import geometry_settings, num_visual_tokens

from .connector_testing import build_model


def _rows(config):
    """Mixed image sizes, image counts 1, 2, 0, 1 and a 2-slice video (a row of its own and beside an image)."""
    return [
        sample(1, config).text(3).image(4, 6).text(4),
        sample(2, config).text(2).image(8, 4).text(1).image(4, 4).text(3),
        sample(3, config).text(7),
        sample(4, config).text(2).image(6, 4).text(1).video(2, 4, 4).text(3),
    ]


def test_a_mixed_batch_equals_each_row_alone(model):
    samples = _rows(model.config)
    batch = batch_inputs(samples)
    with torch.no_grad():
        batched = model(**batch).logits
    generated = model.generate(**batch, max_new_tokens=8, do_sample=False)
    width = batch["input_ids"].shape[1]
    for row, s in enumerate(samples):
        alone = batch_inputs([s])
        with torch.no_grad():
            logits = model(**alone).logits[0]
        real = batch["attention_mask"][row].bool()
        assert (batched[row, real] - logits).abs().max().item() <= 1e-5, row
        alone_generated = model.generate(**alone, max_new_tokens=8, do_sample=False)
        assert torch.equal(generated[row, width:], alone_generated[0, alone["input_ids"].shape[1]:]), row


def test_token_count_function_equals_the_models_feature_count(model):
    rng = random.Random(0)
    grids = [(1, 2 * rng.randint(1, 8), 2 * rng.randint(1, 8)) for _ in range(10)]
    settings = geometry_settings(model.config)
    image_grid = torch.tensor(grids)
    video_grid = torch.tensor([[3, 4, 6]])
    with torch.no_grad():
        images = model.model.get_image_features(torch.randn(int(image_grid.prod(-1).sum()), PATCH_WIDTH), image_grid)
        videos = model.model.get_video_features(torch.randn(72, PATCH_WIDTH), video_grid)
    for grid, features in zip(grids + [(3, 4, 6)], list(images.pooler_output) + list(videos.pooler_output)):
        assert features.shape == (num_visual_tokens(grid, model.config), model.config.text_config.hidden_size), grid
        assert num_visual_tokens(grid, settings) == features.shape[0], grid
    # every DeepStack level carries the main output's token count per item
    assert len(images.deepstack_features) == len(videos.deepstack_features) == 3
    for encoded in (images, videos):
        for level in encoded.deepstack_features:
            assert [f.shape for f in level] == [f.shape for f in encoded.pooler_output]


def test_generation_with_the_cache_equals_generation_without_it(model):
    batch = batch_inputs(_rows(model.config))
    cached = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    uncached = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=False)
    assert cached.shape[1] == batch["input_ids"].shape[1] + 8
    assert torch.equal(cached, uncached)


def test_cached_generation_keeps_a_virtual_query_grid():
    """With mrope_layout="grid" the rope deltas are non-zero; decoding must continue from them."""
    model = build_model("qformer", mrope_layout="grid", query_grid=[2, 3])
    batch = batch_inputs(_rows(model.config))
    cached = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    uncached = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_eager_and_sdpa_agree_on_a_padded_batch(model):
    """The key mask means the same to both kernels (eager adds it, sdpa reads it as a float bias)."""
    batch = batch_inputs(_rows(model.config))
    with torch.no_grad():
        sdpa = model(**batch).logits
        model.set_attn_implementation("eager")
        assert model.model.visual.config._attn_implementation == "eager"
        eager = model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (sdpa - eager)[real].abs().max().item() <= 1e-5

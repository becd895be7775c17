"""Generation beyond the reference: multi-turn with a reused cache and new media, static cache,
inputs_embeds, scores against forward, right padding, statelessness (issue 5)."""

import copy

import pytest
import torch
from helpers import EOS, IMAGE, PAD, VIDEO, batch_inputs, perturb_, sample, tiny_config_dict

import vlmkit


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = perturb_(vlmkit.VLMKitForConditionalGeneration(vlmkit.VLMKitConfig(**tiny_config_dict()))).eval()
    m.generation_config.eos_token_id = EOS
    m.generation_config.pad_token_id = PAD
    return m


def _conversation(turn1, turn2, answer):
    """Inputs for the whole conversation: turn 1's prompt and answer, then turn 2."""
    ids = torch.cat([answer, torch.tensor([turn2.ids])], dim=1)
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    images = turn1.image_pixels + turn2.image_pixels
    if images:
        out["pixel_values"] = torch.cat(images)
        out["image_grid_thw"] = torch.tensor(turn1.images + turn2.images)
    videos = turn1.video_pixels + turn2.video_pixels
    if videos:
        out["pixel_values_videos"] = torch.cat(videos)
        out["video_grid_thw"] = torch.tensor(turn1.videos + turn2.videos)
    return out


@pytest.mark.parametrize("turn2_media", ["image", "video"])
def test_turn_two_continues_turn_ones_cache(model, turn2_media):
    turn1 = sample(1).text(3).image(4, 6).text(4)
    first = model.generate(**batch_inputs([turn1]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                           return_dict_in_generate=True)
    turn2 = sample(2).text(3)
    turn2 = turn2.image(8, 4) if turn2_media == "image" else turn2.video(2, 4, 6)
    turn2.text(3)
    full = _conversation(turn1, turn2, first.sequences)
    with torch.no_grad():
        expected_last = model(**full).logits[0, -1]
    encoded = []
    hook = model.model.visual.register_forward_hook(lambda mod, args, out: encoded.append(args[1].tolist()))
    try:
        continued = model.generate(**full, cache=copy.deepcopy(first.cache), max_new_tokens=8, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert encoded == [[list((turn2.images + turn2.videos)[0])]]  # only the new image / video was encoded
    assert (continued.logits[0][0] - expected_last).abs().max().item() <= 1e-5
    assert torch.equal(continued.sequences, model.generate(**full, max_new_tokens=8, do_sample=False))


def test_continuation_given_only_the_new_image(model):
    turn1 = sample(3).text(2).image(6, 4).text(3)
    first = model.generate(**batch_inputs([turn1]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True)
    turn2 = sample(4).text(2).image(4, 8).text(2)
    full = _conversation(turn1, turn2, first.sequences)
    only_new = {**full, "pixel_values": turn2.image_pixels[0], "image_grid_thw": torch.tensor(turn2.images)}
    out = model.generate(**only_new, cache=copy.deepcopy(first.cache), max_new_tokens=8, do_sample=False)
    assert torch.equal(out, model.generate(**full, max_new_tokens=8, do_sample=False))


def test_first_step_scores_equal_forward_and_teacher_forcing_reproduces_every_step(model):
    for prompt in ([sample(5).text(3).image(4, 6).text(3)], [sample(6).text(2).video(3, 4, 4).text(3)]):
        inputs = batch_inputs(prompt)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                             output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            forward_last = model(**inputs).logits[0, -1]
            teacher = model(**{**inputs, "input_ids": out.sequences, "attention_mask": torch.ones_like(out.sequences),
                               "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(out.logits)))}).logits
        assert (out.scores[0][0] - forward_last).abs().max().item() <= 1e-5
        prompt_length = inputs["input_ids"].shape[1]
        for step, logits in enumerate(out.logits):
            assert (logits[0] - teacher[0, prompt_length - 1 + step]).abs().max().item() <= 1e-5, step


def test_static_cache_equals_dynamic_cache(model):
    inputs = batch_inputs([sample(7).text(3).image(4, 6).text(4), sample(8).text(2).image(6, 4).text(1).video(2, 4, 4).text(3)])
    dynamic = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    static = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False, cache_implementation="static")
    assert torch.equal(dynamic, static)


def test_inputs_embeds_generation_equals_input_ids_generation(model):
    inputs = batch_inputs([sample(9).text(3).image(4, 6).text(2).video(2, 4, 4).text(3)])
    by_ids = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():  # merge the visual features into the embeddings, as a user would
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        for name, pixels, grid, kind in (("image", "pixel_values", "image_grid_thw", 1),
                                         ("video", "pixel_values_videos", "video_grid_thw", 2)):
            feats = getattr(model.model, f"get_{name}_features")(inputs[pixels], inputs[grid]).pooler_output
            mask = (inputs["mm_token_type_ids"] == kind)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, torch.cat(feats))
    by_embeds = model.generate(**{k: v for k, v in inputs.items() if k != "input_ids"}, inputs_embeds=embeds,
                               max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(by_embeds, by_ids[:, inputs["input_ids"].shape[1]:])


def test_right_padding_raises_a_clear_error(model):
    inputs = batch_inputs([sample(10).text(3).image(4, 6).text(4), sample(11).text(5)], padding_side="right")
    with pytest.raises(ValueError, match=r"batch rows \[1\] are right-padded.*left padding"):
        model.generate(**inputs, max_new_tokens=3, do_sample=False)


def test_interleaved_generate_calls_equal_fresh_models(model):
    a = batch_inputs([sample(12).text(2).image(4, 4).text(3)])
    b = batch_inputs([sample(13).text(3).video(2, 4, 4).text(2), sample(14).text(6)])
    fresh = {k: copy.deepcopy(model).generate(**v, max_new_tokens=8, do_sample=False) for k, v in (("a", a), ("b", b))}
    assert torch.equal(model.generate(**a, max_new_tokens=8, do_sample=False), fresh["a"])
    assert torch.equal(model.generate(**b, max_new_tokens=8, do_sample=False), fresh["b"])
    assert torch.equal(model.generate(**a, max_new_tokens=8, do_sample=False), fresh["a"])

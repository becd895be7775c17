"""Logits against transformers' Qwen3VLForConditionalGeneration on the same weights."""

import pytest
import torch
from helpers import batch_inputs, sample
from transformers import Qwen3VLForConditionalGeneration

import vlmkit

CASES = {
    "text_only": lambda: [sample(1).text(12)],
    "one_image": lambda: [sample(2).text(3).image(4, 6).text(4)],
    "two_images_different_grids": lambda: [sample(3).text(3).image(4, 6).text(2).image(8, 8).text(4)],
    # equal segments take the vision tower's batched attention path
    "two_images_same_grid": lambda: [sample(31).text(3).image(6, 4).text(2).image(6, 4).text(4)],
    "video_two_slices": lambda: [sample(4).text(3).video(2, 4, 4).text(4)],
    "video_three_slices": lambda: [sample(41).text(2).video(3, 6, 4).text(3)],
    "image_and_video": lambda: [sample(5).text(3).image(4, 6).text(1).video(2, 4, 4).text(4)],
    "left_padded_batch": lambda: [
        sample(6).text(3).image(4, 6).text(4),
        sample(7).text(9),
        sample(8).text(2).image(6, 4).text(1).image(4, 4).text(3),
    ],
}


@pytest.mark.parametrize("case", CASES)
def test_fp32_logits_match_reference(pair, case):
    ref, ours = pair
    inputs = batch_inputs(CASES[case]())
    with torch.no_grad():
        expected, got = ref(**inputs).logits, ours(**inputs).logits
    real = inputs["attention_mask"].bool()
    assert (expected - got)[real].abs().max().item() <= 1e-5


def test_bf16_logits_agree_with_reference(reference_checkpoint):
    path, _ = reference_checkpoint
    ref = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert ours.dtype == torch.bfloat16
    for case, build in CASES.items():
        inputs = batch_inputs(build(), dtype=torch.bfloat16)
        with torch.no_grad():
            expected, got = ref(**inputs).logits.float(), ours(**inputs).logits.float()
        real = inputs["attention_mask"].bool()
        cosine = torch.nn.functional.cosine_similarity(expected[real], got[real], dim=-1)
        assert cosine.min().item() >= 0.999, case


def test_eager_and_sdpa_agree(reference_checkpoint):
    path, _ = reference_checkpoint
    eager = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    sdpa = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa").eval()
    assert eager.model.visual.config._attn_implementation == "eager"
    assert sdpa.model.language_model.config._attn_implementation == "sdpa"
    inputs = batch_inputs(CASES["left_padded_batch"]() + [sample(9).text(2).video(2, 4, 4).text(2)])
    with torch.no_grad():
        diff = (eager(**inputs).logits - sdpa(**inputs).logits)[inputs["attention_mask"].bool()]
    assert diff.abs().max().item() <= 1e-5


def test_text_only_equals_the_bare_language_model(pair):
    """With equal t/h/w rows, interleaved M-RoPE is plain 1D RoPE (failure mode 4)."""
    _, ours = pair
    inputs = batch_inputs([sample(10).text(15)])
    with torch.no_grad():
        full = ours(**inputs).logits
        hidden = ours.model.language_model(input_ids=inputs["input_ids"]).last_hidden_state
    assert (ours.lm_head(hidden) - full).abs().max().item() <= 1e-6


def test_logits_to_keep_and_loss(pair):
    ref, ours = pair
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(4)])
    labels = inputs["input_ids"].clone()
    labels[inputs["mm_token_type_ids"] > 0] = -100
    with torch.no_grad():
        full = ours(**inputs, labels=labels)
        last = ours(**inputs, logits_to_keep=1).logits
        expected_loss = ref(**inputs, labels=labels).loss
    assert last.shape[1] == 1
    assert (last[:, 0] - full.logits[:, -1]).abs().max().item() <= 1e-6
    assert abs(full.loss.item() - expected_loss.item()) <= 1e-6
    shifted = torch.nn.functional.cross_entropy(full.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    assert abs(full.loss.item() - shifted.item()) <= 1e-6


def test_training_loss_and_gradients_match_reference(pair):
    """The grad-enabled path (no in-place activations) against the reference: loss and every gradient."""
    ref, ours = pair
    inputs = batch_inputs(CASES["image_and_video"]() + CASES["two_images_same_grid"]())
    labels = inputs["input_ids"].masked_fill((inputs["mm_token_type_ids"] > 0) | (inputs["attention_mask"] == 0), -100)
    losses, grads = [], []
    for model in (ref, ours):
        model.train().zero_grad()
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) <= 1e-5
    assert grads[1].keys() <= grads[0].keys() and len(grads[1]) == sum(1 for _ in ours.parameters())
    for name, grad in grads[1].items():
        assert (grad - grads[0][name]).abs().max().item() <= 1e-5, name

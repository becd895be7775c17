"""Packed (padding-free) batches: same per-token loss and LoRA gradients as padded ones, no leakage (item 5)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vlmkit.configuration import mrope_layout
from vlmkit.modeling.packing import flash_varlen_kwargs, packed_position_ids, segment_lengths
from vlmkit.training import IGNORE_INDEX, VLMKitDataCollator, lora_target_modules

from .training_testing import build, image, turn


def _rows() -> list:
    return [
        [turn("user", image(16, 16, 0), "what is in this picture?"), turn("assistant", "a cat")],
        [turn("user", image(24, 16, 1), "describe the image please"), turn("assistant", "a red circle"),
         turn("user", "and now?"), turn("assistant", "hello world")],
        [turn("user", "how many shapes are there"), turn("assistant", "a blue square")],
    ]


def _per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every learned target in one row, in order (logits at i predict labels at i + 1)."""
    targets = labels[1:]
    keep = targets != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[:-1][keep].float(), targets[keep], reduction="none")


def _lora_model(tokenizer, attn: str):
    model, processor = build(tokenizer)
    model.set_attn_implementation(attn)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(model, "all"), init_lora_weights=False)
    return get_peft_model(model, config).train(), processor


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_batch_gives_the_padded_losses_and_lora_gradients(tiny_tokenizer, attn):
    model, processor = _lora_model(tiny_tokenizer, attn)
    rows = _rows()
    padded = VLMKitDataCollator(processor)(rows)
    packed = VLMKitDataCollator(processor, packing=True)(rows)
    lengths = padded["attention_mask"].sum(-1).tolist()
    assert packed["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in packed
    assert segment_lengths(packed["position_ids"]) == [lengths]

    padded_out, padded_grads = _loss_and_grads(model, padded)
    packed_out, packed_grads = _loss_and_grads(model, packed)

    start = 0
    for row, length in enumerate(lengths):  # right padding: row `row` holds its tokens first
        expected = _per_token_losses(padded_out.logits[row, :length], padded["labels"][row, :length])
        got = _per_token_losses(packed_out.logits[0, start:start + length], packed["labels"][0, start:start + length])
        assert expected.numel() > 0 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        start += length
    torch.testing.assert_close(packed_out.loss, padded_out.loss, atol=1e-5, rtol=0)
    left = VLMKitDataCollator(processor, padding_side="left")(rows)
    with torch.no_grad():
        torch.testing.assert_close(model(**left).loss, padded_out.loss, atol=1e-5, rtol=0)
    assert len(padded_grads) == 2 * (28 + 16 + 8) and padded_grads.keys() == packed_grads.keys()
    for name, grad in padded_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_changing_one_sample_leaves_the_others_logits_unchanged(tiny_tokenizer, attn):
    model, processor = build(tiny_tokenizer)
    model.set_attn_implementation(attn)
    model.eval()  # config.use_cache is True: packed inputs must still run without a cache
    packed = VLMKitDataCollator(processor, packing=True)(_rows())
    first = segment_lengths(packed["position_ids"])[0][0]
    changed = {**packed, "input_ids": packed["input_ids"].clone()}
    text = (packed["mm_token_type_ids"][0, :first] == 0).nonzero().flatten()[-6:-2]  # the first sample's answer
    changed["input_ids"][0, text] = (changed["input_ids"][0, text] + 7) % 200 + 10
    with torch.no_grad():
        out = model(**packed)
        again = model(**changed).logits
    assert (again[0, :first] - out.logits[0, :first]).abs().max() > 1e-3
    torch.testing.assert_close(again[0, first:], out.logits[0, first:], atol=1e-6, rtol=0)
    assert out.cache is None
    with pytest.raises(ValueError, match="packed inputs .* cannot be cached"):
        model(**packed, use_cache=True)


def test_packed_positions_are_each_samples_own(tiny_tokenizer):
    """Per segment, M-RoPE equals that of the sample alone (images, a video, adjacent images, text only)."""
    model, processor = build(tiny_tokenizer)
    frames = [image(16, 16, seed) for seed in range(4)]
    rows = [
        [turn("user", image(16, 24, 0), image(16, 16, 1), "hello"), turn("assistant", "a cat")],
        [turn("user", "hello world"), turn("assistant", "a cat")],
        [turn("user", frames, "what is in this picture?"), turn("assistant", "a red circle")],
    ]
    collator = VLMKitDataCollator(processor)
    packed = VLMKitDataCollator(processor, packing=True)(rows)
    inner = model.model
    positions = packed_position_ids(
        packed["position_ids"], packed["mm_token_type_ids"], inner.llm_grids(packed["image_grid_thw"]),
        inner.llm_grids(packed["video_grid_thw"]), mrope_layout(model.config),
    )
    alone = []
    for row in rows:
        sample = collator.encode(row)
        mrope, _ = inner.mrope_position_ids(
            sample["mm_token_type_ids"][None], sample.get("image_grid_thw"), sample.get("video_grid_thw"), None
        )
        alone.append(torch.cat([torch.arange(sample["input_ids"].shape[0])[None, None], mrope]))
    assert torch.equal(positions, torch.cat(alone, dim=-1))
    assert positions[1:, 0].max() < positions[0, 0].max()  # the image rows really differ from the text row


def test_flash_varlen_boundaries_cover_every_row():
    kwargs = flash_varlen_kwargs(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 3, 5, 7, 10]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 3

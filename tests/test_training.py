"""Training step: loss and gradients, with and without gradient checkpointing."""

import torch
from helpers import batch_inputs, sample

from vlmkit.modeling.text import VLMKitTextDecoderLayer
from vlmkit.modeling.vision import VLMKitVisionBlock


def _step(model, inputs, labels):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(reference_checkpoint, load_ours):
    path, _ = reference_checkpoint
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(6), sample(4).text(3).video(2, 4, 4).text(5)])
    labels = inputs["input_ids"].masked_fill(inputs["mm_token_type_ids"] > 0, -100)
    labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)

    plain = load_ours(path).train()
    loss, grads = _step(plain, inputs, labels)

    checkpointed = load_ours(path).train()
    checkpointed.activation_checkpointing_enable()
    layers = [m for m in checkpointed.modules() if isinstance(m, (VLMKitVisionBlock, VLMKitTextDecoderLayer))]
    assert len(layers) == 8 and all(m.gradient_checkpointing for m in layers)
    loss_ckpt, grads_ckpt = _step(checkpointed, inputs, labels)

    assert abs(loss.item() - loss_ckpt.item()) <= 1e-6
    assert grads.keys() == grads_ckpt.keys()
    # every parameter reaches the loss, the vision tower and all DeepStack mergers included
    assert len(grads) == sum(1 for _ in plain.parameters())
    for name in grads:
        assert torch.allclose(grads[name], grads_ckpt[name], atol=1e-6, rtol=1e-5), name
        assert torch.isfinite(grads[name]).all() and grads[name].abs().sum() > 0, name

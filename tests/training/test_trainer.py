"""Trainer + LoRA: the loss falls, every scope gets gradients with either checkpointing mode, gradient
accumulation is token-weighted, stages train what they name, a merged adapter reloads (items 11, 13, 14, 17)."""

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback

import vlmkit
from vlmkit.modeling.text import VLMKitTextDecoderLayer
from vlmkit.modeling.vision import VLMKitVisionBlock
from vlmkit.training import (
    LORA_SCOPES,
    StagedTrainingCallback,
    VLMKitDataCollator,
    VLMKitTrainer,
    connector_module_names,
    lora_target_modules,
    parameter_components,
    per_answer_loss,
    per_sample_loss,
    trainable_names,
)

from .training_testing import build, colour_rows, image, snapshot, trainer, turn


def _lora(model, scope, **kwargs):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora_target_modules(model, scope), **kwargs)
    return get_peft_model(model, config)


def _dataset_loss(model, collator, rows) -> float:
    model.eval()
    with torch.no_grad():
        return model(**collator(rows)).loss.item()


def test_thirty_lora_steps_lower_the_loss_below_080_of_its_start(model_and_processor, tmp_path):
    model, processor = model_and_processor
    rows = colour_rows()
    peft_model = _lora(model, "llm")
    collator = VLMKitDataCollator(processor)
    start = _dataset_loss(peft_model, collator, rows)
    run = trainer(peft_model, processor, rows, tmp_path, max_steps=30, learning_rate=1e-2)
    run.train()
    end = _dataset_loss(peft_model, collator, rows)
    assert end < 0.8 * start, (start, end)
    assert len([h for h in run.state.log_history if "loss" in h]) == 30


class GradientRecorder(TrainerCallback):
    """The gradients of the last optimizer step, just before it."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters() if p.requires_grad}


def _media_rows():
    frames = [image(16, 16, seed) for seed in range(4)]
    return [
        {"messages": [turn("user", image(16, 24, 0), "what is in this picture?"), turn("assistant", "a cat")]},
        {"messages": [turn("user", frames, "describe the image please"), turn("assistant", "a red circle")]},
        {"messages": [turn("user", "hello world"), turn("assistant", "a blue square")]},
    ]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("scope", LORA_SCOPES)
def test_every_trainable_parameter_gets_a_gradient_and_moves(tiny_tokenizer, tmp_path, scope, reentrant):
    model, processor = build(tiny_tokenizer)
    peft_model = _lora(model, scope)
    before = snapshot(peft_model)
    recorder = GradientRecorder()
    run = trainer(peft_model, processor, _media_rows(), tmp_path, max_steps=2, callbacks=[recorder],
                  activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": reentrant})
    run.train()
    layers = [m for m in model.modules() if isinstance(m, (VLMKitVisionBlock, VLMKitTextDecoderLayer))]
    assert len(layers) == 8 and all(layer.gradient_checkpointing for layer in layers)
    # reentrant checkpointing needs inputs that require grad in both towers
    assert model.model.visual.patch_embed._forward_hooks and model.model.language_model.embed_tokens._forward_hooks
    # the second step: LoRA's B starts at zero, so A's first gradient is zero by construction
    assert recorder.grads.keys() == before.keys() and len(before) > 0
    for name, grad in recorder.grads.items():
        assert grad is not None, name
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    after = snapshot(peft_model)
    assert [n for n in before if torch.equal(before[n], after[n])] == []


def test_gradient_accumulation_equals_one_large_batch(tiny_tokenizer, tmp_path):
    """2 micro-batches of 2 with 2 and 13 learned tokens: the loss and SGD update of one batch of 4."""
    long_answer = "a red circle and a blue square and a cat sitting on a mat"
    rows = [
        {"messages": [turn("user", image(16, 16, 0), "hello"), turn("assistant", "a")]},
        {"messages": [turn("user", "hello world"), turn("assistant", "a")]},
        {"messages": [turn("user", image(16, 24, 1), "describe the image please"), turn("assistant", long_answer)]},
        {"messages": [turn("user", "how many shapes are there"), turn("assistant", long_answer)]},
    ]

    def fresh():
        model, processor = build(tiny_tokenizer)
        torch.manual_seed(1)  # the same adapter weights every time
        return _lora(model, "all", init_lora_weights=False), processor

    peft_model, processor = fresh()
    collator = VLMKitDataCollator(processor)
    counts = [int((collator(rows[i:i + 2])["labels"] != -100).sum()) for i in (0, 2)]
    assert counts[0] * 3 < counts[1]  # per-batch means would weight the two micro-batches equally
    direct = _dataset_loss(peft_model, collator, rows)
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        peft_model, processor = fresh()
        before = snapshot(peft_model)
        run = trainer(peft_model, processor, rows, tmp_path, per_device_train_batch_size=batch_size,
                      gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5)
        run.train()
        after = snapshot(peft_model)
        results.append((run.state.log_history[0]["loss"], {n: after[n] - before[n] for n in before}))
    (loss_big, step_big), (loss_accumulated, step_accumulated) = results
    assert loss_big == pytest.approx(direct, abs=1e-5)
    assert loss_accumulated == pytest.approx(loss_big, abs=1e-5)
    for name, delta in step_big.items():
        assert delta.abs().sum() > 0, name
        torch.testing.assert_close(step_accumulated[name], delta, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("loss_func", [per_sample_loss, per_answer_loss])
def test_sample_weighted_loss_under_accumulation_needs_the_trainer_to_divide(tiny_tokenizer, tmp_path, loss_func):
    """2 micro-batches of 2 samples give one batch of 4's loss and SGD step once the Trainer divides each
    micro-batch's mean by the accumulation steps: VLMKitTrainer does, from the loss function's own
    `loss_is_scaled_for_ga = False`, and so does a plain Trainer told so. A plain Trainer left to decide
    (None) treats a `compute_loss_func`'s loss as scaled already, and the step doubles."""
    rows = [{"messages": [turn("user", image(16, 16, i), "what is it"), turn("assistant", answer)]}
            for i, answer in enumerate(["a", "a red circle and a blue square", "a cat", "two"])]

    def run(batch_size, accumulation, trainer_class=Trainer, scaled=None):
        model, processor = build(tiny_tokenizer)
        before = snapshot(model)
        run = trainer(model, processor, rows, tmp_path, trainer_class=trainer_class, compute_loss_func=loss_func,
                      per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                      optim="sgd", learning_rate=0.5, max_grad_norm=0.0)  # clipping would hide a doubled gradient
        if scaled is not None:
            run.loss_is_scaled_for_ga = scaled
        run.train()
        after = snapshot(model)
        return run.state.log_history[0]["loss"], {n: after[n] - before[n] for n in before}

    loss_big, step_big = run(4, 1)
    moved = [n for n, delta in step_big.items() if delta.abs().sum() > 0]
    assert moved
    for trainer_class, scaled in ((VLMKitTrainer, None), (Trainer, False)):
        loss_divided, step_divided = run(2, 2, trainer_class, scaled)
        assert loss_divided == pytest.approx(loss_big, abs=1e-5), trainer_class
        for name in moved:
            torch.testing.assert_close(step_divided[name], step_big[name], atol=1e-6, rtol=1e-4, msg=name)
    loss_undivided, step_undivided = run(2, 2)
    assert loss_undivided == pytest.approx(2 * loss_big, abs=1e-4)
    name = max(moved, key=lambda n: step_big[n].abs().sum())
    torch.testing.assert_close(step_undivided[name], 2 * step_big[name], atol=1e-6, rtol=1e-4)


def test_vlmkit_trainer_takes_the_scaling_a_loss_function_declares(model_and_processor, tmp_path):
    """per_sample_loss and per_answer_loss declare per-micro-batch means, also through functools.partial;
    a loss function that declares nothing, or none at all, keeps transformers' default (None)."""
    model, processor = model_and_processor
    rows = colour_rows()

    def undeclared(outputs, labels, num_items_in_batch=None):
        return per_sample_loss(outputs, labels)

    declared = {per_sample_loss: False, per_answer_loss: False, functools.partial(per_answer_loss): False,
                undeclared: None, None: None}
    for loss_func, expected in declared.items():
        run = trainer(model, processor, rows, tmp_path, trainer_class=VLMKitTrainer, compute_loss_func=loss_func)
        assert run.loss_is_scaled_for_ga is expected, loss_func
        assert run.compute_loss_func is loss_func


def test_a_text_only_batch_keeps_every_visual_parameter_in_the_graph(model_and_processor):
    model, processor = model_and_processor
    batch = VLMKitDataCollator(processor)([[turn("user", "hello world"), turn("assistant", "a cat")]])
    calls = []
    model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    peft_model = _lora(model, "all").train()
    loss = peft_model(**batch).loss
    loss.backward()
    visual = {n: p for n, p in peft_model.named_parameters() if p.requires_grad and ".visual." in n}
    assert calls == [1] and len(visual) == 2 * (16 + 8)
    for name, param in visual.items():  # in the graph (DDP's reducer sees it), and with a zero gradient
        assert param.grad is not None and not param.grad.any(), name
    for name, param in peft_model.named_parameters():
        param.requires_grad_(".visual." not in name and "lora_" in name)
    assert peft_model(**batch).loss.item() == loss.item()  # without trainable visual weights: no dummy pass
    assert calls == [1]


class ParameterHistory(TrainerCallback):
    def __init__(self):
        self.states = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.on_step_begin(args, state, control, model=model)


def test_staged_callback_trains_exactly_the_components_of_each_stage(model_and_processor, tmp_path):
    model, processor = model_and_processor
    peft_model = _lora(model, "llm")
    stages = [(0, ["connector"]), (2, ["connector", "llm"]), (4, ["vision"])]
    history = ParameterHistory()
    run = trainer(peft_model, processor, _media_rows(), tmp_path, max_steps=6, learning_rate=1e-3,
                  callbacks=[StagedTrainingCallback(stages), history])
    run.train()
    owners = parameter_components(peft_model)
    for (first, components), last in zip(stages, (2, 4, 6)):
        changed = {n for n, p in history.states[last].items() if not torch.equal(p, history.states[first][n])}
        expected = set(trainable_names(peft_model, components))
        assert changed == expected, (components, sorted(changed ^ expected)[:5])
        assert {owners[n] for n in changed} == set(components)
    # the connector trains in full (it has no adapter), the LLM through its LoRA weights only
    assert all("lora_" in n for n in trainable_names(peft_model, ["llm"]))
    assert not any("lora_" in n for n in trainable_names(peft_model, ["connector"]))


def test_stages_outside_the_optimizer_are_refused(model_and_processor, tmp_path):
    model, processor = model_and_processor
    peft_model = _lora(model, "llm")
    run = trainer(peft_model, processor, _media_rows(), tmp_path, max_steps=1)
    run.add_callback(StagedTrainingCallback([(0, ["vision"])]))  # after init: the optimizer lacks the tower
    with pytest.raises(ValueError, match="not in the optimizer"):
        run.train()


def test_merged_adapter_saves_and_reloads_with_the_adapter_logits(model_and_processor, tmp_path):
    """LoRA on the LLM and the vision tower, the connector trained in full (modules_to_save)."""
    model, processor = model_and_processor
    config = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(model, ("llm", "vision")),
                        modules_to_save=connector_module_names(model), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    run = trainer(peft_model, processor, _media_rows(), tmp_path / "run", max_steps=2, learning_rate=1e-2)
    run.train()
    peft_model.eval()
    batch = VLMKitDataCollator(processor)(_media_rows())
    with torch.no_grad():
        adapted = peft_model(**batch).logits
        merged = peft_model.merge_and_unload()
        assert type(merged) is vlmkit.VLMKitForConditionalGeneration
        merged.save_pretrained(tmp_path / "merged")
        reloaded = vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
        again = reloaded(**batch).logits
    assert not any("lora" in k or "modules_to_save" in k for k in reloaded.state_dict())
    torch.testing.assert_close(again, adapted, atol=1e-5, rtol=0)

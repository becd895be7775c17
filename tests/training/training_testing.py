"""Tiny models, chat rows and Trainer runs shared by the training tests."""

import numpy as np
import torch
from conftest import make_processor
from helpers import perturb_, tiny_vlmkit_config_for
from PIL import Image
from transformers import Trainer, TrainingArguments

import vlmkit
from vlmkit.training import VLMKitDataCollator

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220)}


def image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def solid(colour: str, height: int = 16, width: int = 16) -> Image.Image:
    return Image.new("RGB", (width, height), COLOURS[colour])


def turn(role: str, *content) -> dict:
    """A message; str items are text, PIL images are images, lists of images are videos."""
    items = []
    for item in content:
        if isinstance(item, str):
            items.append({"type": "text", "text": item})
        elif isinstance(item, list):
            items.append({"type": "video", "video": item, "fps": 2.0})
        else:
            items.append({"type": "image", "image": item})
    return {"role": role, "content": items}


def two_turn_two_images() -> list[dict]:
    return [
        {"role": "system", "content": "hello world"},
        turn("user", image(16, 16, 0), "what is in this picture?"),
        turn("assistant", "a cat"),
        turn("user", image(16, 24, 1), "and now?"),
        turn("assistant", "a red circle and a blue square"),
    ]


def colour_rows() -> list[dict]:
    """A small fixed dataset: colour questions on solid images of two sizes, a text-only row per colour."""
    rows = []
    for colour in COLOURS:
        rows.append({"messages": [turn("user", solid(colour), "what is in this picture?"),
                                  turn("assistant", f"a {colour} square")]})
        rows.append({"messages": [turn("user", solid(colour, 16, 24), "describe the image please"),
                                  turn("assistant", f"the image is {colour}")]})
        rows.append({"messages": [turn("user", f"how many shapes are there {colour}"),
                                  turn("assistant", "hello world")]})
    return rows


def build(tokenizer, seed: int = 0, **overrides):
    """A tiny perturbed model and the processor that counts its connector's tokens."""
    config = tiny_vlmkit_config_for(tokenizer, **overrides)
    torch.manual_seed(seed)
    model = perturb_(vlmkit.VLMKitForConditionalGeneration(config), seed)
    base = make_processor(tokenizer)
    processor = vlmkit.VLMKitProcessor.for_model(
        config, tokenizer, image_processor=base.image_processor, video_processor=base.video_processor
    )
    return model, processor


def trainer(model, processor, rows, output_dir, callbacks=None, trainer_class=Trainer, compute_loss_func=None,
            **args) -> Trainer:
    settings = dict(
        per_device_train_batch_size=3, max_steps=1, learning_rate=1e-2, logging_steps=1, report_to=[],
        remove_unused_columns=False, save_strategy="no", use_cpu=True, disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0, seed=0,
    )
    settings.update(args)
    return trainer_class(
        model=model, args=TrainingArguments(output_dir=str(output_dir), **settings), train_dataset=rows,
        data_collator=VLMKitDataCollator(processor), callbacks=callbacks, compute_loss_func=compute_loss_func,
    )


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}

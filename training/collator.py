"""The data collator: chat rows with images and videos -> model-ready batches with assistant-only labels.

Each row goes through the processor's chat template with `return_assistant_tokens_mask=True`; the
template's `{% generation %}` markers cover exactly each assistant turn's content and its <|im_end|>,
and only those tokens keep their label. Everything else is -100: the system and user turns, the
role headers, every token of a vision span (<|vision_start|> ... <|vision_end|>, the image and video
placeholders and a video's "<t seconds>" timestamps between them) and padding.

A row never gets truncated: cutting it could split a vision span (the placeholder count would no
longer match the pixels) or drop the answer's end token. A row longer than `max_length` raises a
ValueError naming its index in the batch, its length and `max_length`, or with `overflow="drop"`
is left out with a warning.

Padded batches (default): `input_ids`, `attention_mask`, `mm_token_type_ids`, `labels` of shape
(B, S), and the processor's `pixel_values` / `image_grid_thw` / `pixel_values_videos` /
`video_grid_thw` concatenated over the batch in row order.

Packed batches (`packing=True`): the batch's rows one after another in a single row (1, sum of
lengths), no padding and no attention mask, and `position_ids` (1, S) restarting at 0 where each
sample begins. The model reads the sample boundaries from those positions: attention stays inside
each sample and each sample gets its own M-RoPE positions (vlmkit/modeling/packing.py).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

IGNORE_INDEX = -100
OVERFLOW_MODES = ("raise", "drop")
VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class VLMKitDataCollator:
    """Collate chat rows for `Trainer`: assistant-only labels, no truncation, padded or packed.

    Args:
        processor: a `VLMKitProcessor` built for the model (`VLMKitProcessor.for_model(config, tokenizer)`).
        max_length: longest sample allowed, in tokens after image and video expansion (None: no limit).
        packing: put the whole batch in one row without padding (see the module docstring).
        overflow: what to do with a sample longer than `max_length`: "raise" (ValueError) or "drop" (warning).
        padding_side: "right" (default) or "left", for padded batches.
        pad_to_multiple_of: round the padded length up to a multiple of this.
        messages_key: the row field holding the messages when rows are mappings.
        processor_kwargs: extra keyword arguments for the processor call (for example `max_pixels`).

    A row is a list of messages, or a mapping with the messages under `messages_key`. Images and videos
    sit in the content (`{"type": "image", "image": PIL image}`, `{"type": "video", "video": frames}`),
    or, TRL style, in the row's "images" / "videos" lists filling the content's bare
    `{"type": "image"}` / `{"type": "video"}` items in order. A video's frame rate comes from its
    item's "fps" (or "video_metadata"), else from the row's "fps".
    """

    def __init__(
        self,
        processor,
        max_length: int | None = None,
        packing: bool = False,
        overflow: str = "raise",
        padding_side: str = "right",
        pad_to_multiple_of: int | None = None,
        messages_key: str = "messages",
        processor_kwargs: dict | None = None,
    ):
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be a positive number of tokens, got {max_length}")
        self.processor = processor
        self.max_length = max_length
        self.packing = packing
        self.overflow = overflow
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.messages_key = messages_key
        self.processor_kwargs = dict(processor_kwargs or {})
        tokenizer = processor.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vision_start_id = processor.vision_start_token_id
        self.vision_end_id = processor.vision_end_token_id
        self.placeholder_ids = (processor.image_token_id, processor.video_token_id)

    # ------------------------------------------------------------------------------- rows
    def _messages(self, row: Any, index: int) -> tuple[list[dict], list[dict | None]]:
        """The row's messages with its images and videos inlined, and one metadata entry per video."""
        if isinstance(row, Mapping):
            if self.messages_key not in row:
                raise ValueError(f"sample {index} has no {self.messages_key!r} field (fields: {sorted(row)})")
            messages, extra = row[self.messages_key], row
        elif isinstance(row, Sequence) and not isinstance(row, str):
            messages, extra = row, {}
        else:
            raise TypeError(f"sample {index}: expected a list of messages or a mapping, got {type(row).__name__}")
        media = {kind: list(extra.get(f"{kind}s") or []) for kind in ("image", "video")}
        used = {"image": 0, "video": 0}
        metadata, out = [], []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) or content is None:
                out.append(dict(message))
                continue
            items = []
            for item in content:
                kind = item.get("type")
                if kind in media:
                    item = dict(item)
                    if kind not in item:
                        if used[kind] >= len(media[kind]):
                            raise ValueError(
                                f"sample {index}: its messages hold more {kind} items than the {len(media[kind])} "
                                f"{kind}(s) of its {kind}s field"
                            )
                        item[kind] = media[kind][used[kind]]
                        used[kind] += 1
                    if kind == "video":
                        metadata.append(self._video_metadata(item, extra))
                items.append(item)
            out.append({**message, "content": items})
        for kind, given in media.items():
            if used[kind] != len(given):
                raise ValueError(
                    f"sample {index}: {len(given)} {kind}(s) given in its {kind}s field but its messages place "
                    f"{used[kind]}"
                )
        return out, metadata

    @staticmethod
    def _video_metadata(item: dict, row: Mapping) -> dict | None:
        meta = dict(item.get("video_metadata") or {})
        fps = item.get("fps", meta.get("fps", row.get("fps")))
        if fps is not None:
            meta["fps"] = float(fps)
        return meta or None

    def encode(self, row: Any, index: int = 0) -> dict[str, torch.Tensor]:
        """One row -> 1-D `input_ids`, `mm_token_type_ids`, `labels` and its pixels and grids (if any)."""
        messages, metadata = self._messages(row, index)
        kwargs = dict(self.processor_kwargs)
        if metadata:
            kwargs["video_metadata"] = metadata
        out = self.processor.apply_chat_template(
            [messages], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt",
            processor_kwargs=kwargs,
        )
        input_ids = out["input_ids"][0]
        learned = out["assistant_masks"][0].bool() & ~self.vision_mask(input_ids)
        sample = {
            "input_ids": input_ids,
            "mm_token_type_ids": out["mm_token_type_ids"][0],
            "labels": input_ids.masked_fill(~learned, IGNORE_INDEX),
        }
        for key in VISUAL_KEYS:
            if key in out:
                sample[key] = out[key]
        return sample

    def vision_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(S,) bool: tokens of a vision span, from <|vision_start|> to its <|vision_end|> (nested video
        blocks and their timestamps included), and any image or video placeholder."""
        starts = input_ids == self.vision_start_id
        ends = input_ids == self.vision_end_id
        depth = starts.long().cumsum(0) - ends.long().cumsum(0)  # open spans after each token
        placeholders = (input_ids == self.placeholder_ids[0]) | (input_ids == self.placeholder_ids[1])
        return (depth > 0) | ends | placeholders

    def _fits(self, sample: dict, index: int) -> bool:
        length = sample["input_ids"].shape[0]
        if self.max_length is None or length <= self.max_length:
            return True
        vision = int(self.vision_mask(sample["input_ids"]).sum())
        message = (
            f"sample {index} of the batch is {length} tokens long, more than max_length={self.max_length} "
            f"({vision} of them in vision spans); vlmkit never truncates a sample, since a cut could split "
            "an image or video span or drop the answer's end token"
        )
        if self.overflow == "raise":
            raise ValueError(message + ". Raise max_length, shrink the images (max_pixels), or pass overflow='drop'.")
        logger.warning(message + "; it is dropped (overflow='drop').")
        return False

    # ------------------------------------------------------------------------------ batch
    def __call__(self, rows: Sequence[Any]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(row, index) for index, row in enumerate(rows)]
        samples = [s for index, s in enumerate(encoded) if self._fits(s, index)]
        if not samples:
            raise ValueError(
                f"all {len(rows)} samples of the batch are longer than max_length={self.max_length} "
                f"(lengths {[s['input_ids'].shape[0] for s in encoded]}); nothing is left to train on"
            )
        batch = self._pack(samples) if self.packing else self._pad(samples)
        for key in VISUAL_KEYS:  # concatenated over the batch, in row order (no batch dimension)
            parts = [s[key] for s in samples if key in s]
            if parts:
                batch[key] = torch.cat(parts)
        return batch

    def _pad(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        length = max(s["input_ids"].shape[0] for s in samples)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": torch.full((len(samples), length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(len(samples), length, dtype=torch.long),
            "mm_token_type_ids": torch.zeros(len(samples), length, dtype=torch.long),
            "labels": torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long),
        }
        for row, sample in enumerate(samples):
            n = sample["input_ids"].shape[0]
            span = slice(length - n, length) if self.padding_side == "left" else slice(0, n)
            for key in ("input_ids", "mm_token_type_ids", "labels"):
                batch[key][row, span] = sample[key]
            batch["attention_mask"][row, span] = 1
        return batch

    def _pack(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        labels = []
        for sample in samples:
            # the first token of a sample is never a target: the shifted loss would predict it from the
            # previous sample's last token
            labels.append(torch.cat([torch.tensor([IGNORE_INDEX]), sample["labels"][1:]]))
        return {
            "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
            "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat([torch.arange(s["input_ids"].shape[0]) for s in samples])[None],
        }

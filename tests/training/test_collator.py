"""The collator's labels (assistant content and <|im_end|> only) and its refusal to truncate (items 14, 15)."""

import pytest
import torch
from conftest import make_processor

from vlmkit.training import IGNORE_INDEX, VLMKitDataCollator

from .training_testing import image, turn, two_turn_two_images


def _expected_learned(ids: list[int], tokenizer) -> list[int]:
    """Positions after each `<|im_start|>assistant\\n` header up to and including the next <|im_end|>."""
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    positions = []
    for start in range(len(ids) - len(header) + 1):
        if ids[start:start + len(header)] == header:
            pos = start + len(header)
            while ids[pos] != end:
                positions.append(pos)
                pos += 1
            positions.append(pos)
    return positions


def test_two_turns_with_two_images_learn_exactly_the_assistant_spans(tiny_tokenizer):
    processor = make_processor(tiny_tokenizer)
    rows = [two_turn_two_images(), [turn("user", "hello world"), turn("assistant", "a cat")]]
    batch = VLMKitDataCollator(processor)(rows)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    for row in range(2):
        real = batch["attention_mask"][row].bool()
        ids = batch["input_ids"][row][real].tolist()
        labels = batch["labels"][row]
        learned = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        assert learned == _expected_learned(ids, tiny_tokenizer)  # right padding: real tokens come first
        assert torch.equal(labels[learned], batch["input_ids"][row][learned])
    first = batch["labels"][0]
    assert tiny_tokenizer.decode(first[first != IGNORE_INDEX]) == (
        "a cat<|im_end|>a red circle and a blue square<|im_end|>"
    )
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == IGNORE_INDEX).all()
    assert int((batch["attention_mask"][1] == 0).sum()) > 0


def test_vision_spans_and_video_timestamps_are_never_learned(tiny_tokenizer):
    """Even inside an assistant turn: an image the assistant shows and a video's `<t seconds>` stamps."""
    processor = make_processor(tiny_tokenizer)
    frames = [image(16, 16, seed) for seed in range(4)]
    row = [turn("user", frames, "describe the image please"), turn("assistant", "look: ", image(16, 16, 9), "a cat")]
    collator = VLMKitDataCollator(processor)
    batch = collator([row])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert tiny_tokenizer.decode(labels[labels != IGNORE_INDEX]) == "look: a cat<|im_end|>"
    # slices of frames (0, 1) and (2, 3) at 2 fps: mean times 0.25 and 1.25 s, written :.1f
    slices = "".join(f"<{t} seconds><|vision_start|>" + "<|video_pad|>" * 4 + "<|vision_end|>" for t in ("0.2", "1.2"))
    video = "<|vision_start|>" + slices + "<|vision_end|>"
    picture = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"
    vision = collator.vision_mask(ids)
    assert tiny_tokenizer.decode(ids[vision]) == video + picture
    assert (labels[vision] == IGNORE_INDEX).all()


def test_trl_style_rows_give_the_same_batch(tiny_tokenizer):
    processor = make_processor(tiny_tokenizer)
    inline = two_turn_two_images()
    images = [item["image"] for message in inline if isinstance(message["content"], list)
              for item in message["content"] if item["type"] == "image"]
    bare = [{**m, "content": [{"type": "image"} if i["type"] == "image" else i for i in m["content"]]}
            if isinstance(m["content"], list) else m for m in inline]
    collator = VLMKitDataCollator(processor)
    a, b = collator([inline]), collator([{"messages": bare, "images": images}])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="sample 0: 3 image"):
        collator([{"messages": bare, "images": images + images[:1]}])


def _last_image_span(ids: list[int], processor) -> tuple[int, int]:
    """First and last position of the last run of image placeholders."""
    last = len(ids) - 1 - ids[::-1].index(processor.image_token_id)
    first = last
    while ids[first - 1] == processor.image_token_id:
        first -= 1
    return first, last


@pytest.mark.parametrize("where", ["before_span", "inside_span", "after_span", "one_short"])
def test_a_sample_longer_than_max_length_raises_or_is_dropped_never_cut(tiny_tokenizer, where, caplog):
    processor = make_processor(tiny_tokenizer)
    long_row = two_turn_two_images()
    short_row = [turn("user", image(16, 16, 3), "hello"), turn("assistant", "a cat")]
    length = VLMKitDataCollator(processor).encode(long_row)["input_ids"].shape[0]
    ids = VLMKitDataCollator(processor).encode(long_row)["input_ids"].tolist()
    first, last = _last_image_span(ids, processor)
    max_length = {"before_span": first - 1, "inside_span": first + 2, "after_span": last + 2,
                  "one_short": length - 1}[where]
    assert max_length >= VLMKitDataCollator(processor).encode(short_row)["input_ids"].shape[0]

    with pytest.raises(ValueError) as error:
        VLMKitDataCollator(processor, max_length=max_length)([short_row, long_row])
    assert f"sample 1 of the batch is {length} tokens long, more than max_length={max_length}" in str(error.value)

    batch = VLMKitDataCollator(processor, max_length=max_length, overflow="drop")([short_row, long_row])
    assert f"is {length} tokens long" in caplog.text
    assert batch["input_ids"].shape[0] == 1 and batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == 4 == batch["pixel_values"].shape[0] // 4
    kept = VLMKitDataCollator(processor, max_length=length)([short_row, long_row])
    assert kept["input_ids"].shape == (2, length)


def test_every_sample_too_long_raises(tiny_tokenizer):
    processor = make_processor(tiny_tokenizer)
    expected = r"all 1 samples of the batch are longer than max_length=5 \(lengths \[\d+\]\)"
    with pytest.raises(ValueError, match=expected):
        VLMKitDataCollator(processor, max_length=5, overflow="drop")([two_turn_two_images()])

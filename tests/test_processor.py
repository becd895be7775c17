"""VLMKitProcessor against transformers' Qwen3VLProcessor, validation, and save/load."""

import json

import numpy as np
import pytest
import torch
from conftest import make_processor
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import vlmkit


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor, which needs torchvision (qwen3vl_reference 5.3)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                         chat_template=chat_template, **kwargs)


def _image(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _conversation(images, text):
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def test_identical_to_qwen3vl_processor_for_0_1_and_2_images(tiny_tokenizer, tiny_processor):
    reference_images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                size={"shortest_edge": 64, "longest_edge": 4096})
    reference = ImageOnlyQwen3VLProcessor(image_processor=reference_images, tokenizer=tiny_tokenizer,
                                          chat_template=tiny_processor.chat_template)
    batch = [
        _conversation([], "hello world"),
        _conversation([_image(30, 50, 1)], "describe the image please"),
        _conversation([_image(64, 20, 2), _image(17, 93, 3)], "how many shapes are there"),
    ]
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
                  processor_kwargs={"padding": True})
    expected = reference.apply_chat_template(batch, **kwargs)
    got = tiny_processor.apply_chat_template(batch, **kwargs)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(expected[key], got[key]), key
    assert (expected["pixel_values"] - got["pixel_values"]).abs().max().item() <= 1e-6
    assert (got["attention_mask"][:, 0] == 0).any()  # padded on the left
    assert got["image_grid_thw"].shape == (3, 3)


def test_images_that_do_not_match_placeholders(tiny_processor):
    one = "<|vision_start|><|image_pad|><|vision_end|>what is in this picture?"
    two = one + one
    with pytest.raises(ValueError, match=r"sample 1: its text holds 2 image placeholder\(s\) but 1 image\(s\) were given"):
        tiny_processor(text=[one, two], images=[[_image(16, 16, 0)], [_image(16, 16, 1)]])
    with pytest.raises(ValueError, match=r"sample 0: its text holds 0 image placeholder\(s\) but 1 image\(s\)"):
        tiny_processor(text=["hello world", one], images=[[_image(16, 16, 0)], [_image(16, 16, 1)]])
    with pytest.raises(ValueError, match=r"holds 3 image placeholder\(s\) \(per sample: \[1, 2\]\) but 2 image\(s\)"):
        tiny_processor(text=[one, two], images=[_image(16, 16, 0), _image(16, 16, 1)])
    with pytest.raises(ValueError, match=r"holds 0 video placeholder\(s\) \(per sample: \[0\]\) but 1 video"):
        tiny_processor(text="hello", videos=[[_image(16, 16, 0)] * 2])


def test_truncation_never_cuts_a_vision_span(tiny_processor):
    text = "hello world <|vision_start|><|image_pad|><|vision_end|> what is in this picture? a cat sitting on a mat"
    image = _image(16, 16, 0)  # -> 4 image tokens
    full = tiny_processor(text=text, images=[image])["input_ids"][0]
    vision_end = full.index(tiny_processor.vision_end_token_id)
    with pytest.raises(ValueError, match=rf"sample 0 is {len(full)} tokens long; truncating it to max_length=5 would cut"):
        tiny_processor(text=text, images=[image], truncation=True, max_length=5)
    ok = tiny_processor(text=text, images=[image], truncation=True, max_length=vision_end + 2)
    assert len(ok["input_ids"][0]) == vision_end + 2
    assert sum(ok["mm_token_type_ids"][0]) == 4


def test_save_and_reload_keeps_every_setting(tmp_path, tiny_tokenizer):
    processor = make_processor(tiny_tokenizer, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.25])
    processor.video_processor.fps = 3.0
    processor.geometry = {"connector_type": "merger", "spatial_merge_size": 2}
    processor.save_pretrained(tmp_path)
    again = vlmkit.VLMKitProcessor.from_pretrained(tmp_path)
    auto = AutoProcessor.from_pretrained(tmp_path)
    assert type(auto) is vlmkit.VLMKitProcessor
    for loaded in (again, auto):
        assert loaded.chat_template == processor.chat_template
        assert loaded.geometry == processor.geometry
        assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()
        assert loaded.video_processor.to_dict() == processor.video_processor.to_dict()
        assert loaded.tokenizer.padding_side == "left"
        assert loaded.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    text = "<|vision_start|><|image_pad|><|vision_end|>hello"
    image = _image(20, 28, 4)
    a, b = processor(text=text, images=[image]), again(text=text, images=[image])
    assert a["input_ids"] == b["input_ids"] and np.array_equal(a["pixel_values"], b["pixel_values"])


def test_reads_the_official_qwen3vl_processor_layout(tmp_path, tiny_tokenizer):
    """preprocessor_config.json naming Qwen2VLImageProcessorFast, chat_template.json, no video config."""
    tiny_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
    }))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": vlmkit.processing.CHAT_TEMPLATE}))
    processor = vlmkit.VLMKitProcessor.from_pretrained(tmp_path)
    assert type(processor.image_processor) is vlmkit.VLMKitImageProcessor
    assert processor.image_processor.patch_size == 16 and processor.image_processor.max_pixels == 16777216
    assert processor.video_processor.patch_size == 16
    assert processor.chat_template == vlmkit.processing.CHAT_TEMPLATE
    out = processor(text="<|vision_start|><|image_pad|><|vision_end|>", images=[_image(64, 96, 0)])
    reference = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                         size={"shortest_edge": 65536, "longest_edge": 16777216})
    assert out["image_grid_thw"].tolist() == reference(_image(64, 96, 0))["image_grid_thw"].tolist() == [[1, 14, 20]]


def test_chat_template_marks_assistant_content_and_end_token(tiny_processor):
    conversation = _conversation([_image(16, 16, 0)], "what is in this picture?") + [
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
        {"role": "assistant", "content": "a red circle"},
    ]
    out = tiny_processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"][0], out["assistant_masks"][0]
    learned = tiny_processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert learned == "a cat<|im_end|>a red circle<|im_end|>"
    rendered = tiny_processor.apply_chat_template(conversation[:1], add_generation_prompt=True, add_vision_id=True)
    assert rendered == ("<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>what is in this "
                        "picture?<|im_end|>\n<|im_start|>assistant\n")


def test_build_tokenizer_can_spell_numbers_digit_by_digit(tmp_path):
    corpus = ["[120, 345, 678, 1000]", "[12, 34, 560, 999]", "how many shapes are there? 3"] * 50
    merged = vlmkit.build_tokenizer(corpus, vocab_size=300)
    digits = vlmkit.build_tokenizer(corpus, vocab_size=300, split_digits=True)
    text = "[120, 345, 678, 1000]"
    assert any(len(t.lstrip("Ġ")) > 1 and t.lstrip("Ġ").isdigit() for t in merged.tokenize(text))  # merges learned digit runs
    assert digits.tokenize(text) == ["[", "1", "2", "0", ",", "Ġ", "3", "4", "5", ",", "Ġ", "6", "7", "8", ",", "Ġ",
                                     "1", "0", "0", "0", "]"]
    assert digits.decode(digits(text)["input_ids"]) == text
    digits.save_pretrained(tmp_path)  # the split survives saving: the saved tokenizer spells the same
    assert AutoTokenizer.from_pretrained(tmp_path).tokenize(text) == digits.tokenize(text)

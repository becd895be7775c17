"""The processor's placeholder counts equal every connector's feature count; pipeline per connector."""

import random

import numpy as np
import pytest
import torch
from conftest import make_processor
from helpers import TINY_CONNECTOR_CONFIG, perturb_, tiny_vlmkit_config_for
from PIL import Image
from transformers import pipeline

import vlmkit
from vlmkit.configuration import geometry_settings


def _model_and_processor(connector_type, tokenizer):
    config = tiny_vlmkit_config_for(tokenizer, connector_type=connector_type, connector_config=dict(TINY_CONNECTOR_CONFIG))
    torch.manual_seed(0)
    model = perturb_(vlmkit.VLMKitForConditionalGeneration(config), seed=1, scale=0.5).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    processor = make_processor(tokenizer)
    processor.geometry = geometry_settings(config)
    return model, processor


def _image(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_placeholder_count_equals_feature_count(connector_type, tiny_tokenizer):
    model, processor = _model_and_processor(connector_type, tiny_tokenizer)
    rng = random.Random(1)
    images = [_image(rng.randint(8, 72), rng.randint(8, 72), i) for i in range(10)]
    frames = [_image(24, 40, 20 + i) for i in range(5)]
    text = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images)
    text += "<|vision_start|><|video_pad|><|vision_end|>how many shapes are there"
    inputs = processor(text=text, images=images, videos=[frames], video_metadata={"fps": 2.0}, return_tensors="pt")
    types = inputs["mm_token_type_ids"][0]
    with torch.no_grad():
        image_features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        video_features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
        logits = model(**inputs).logits  # raises if placeholders and features disagree
    assert int((types == 1).sum()) == sum(f.shape[0] for f in image_features)
    assert int((types == 2).sum()) == video_features[0].shape[0]
    assert len(set(tuple(g) for g in inputs["image_grid_thw"].tolist())) >= 5  # sizes really vary
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_pipeline_runs_with_every_connector(connector_type, tiny_tokenizer, tmp_path):
    model, processor = _model_and_processor(connector_type, tiny_tokenizer)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    pipe = pipeline("image-text-to-text", model=str(tmp_path))
    assert pipe.processor.geometry == geometry_settings(model.config)
    chat = [{"role": "user", "content": [{"type": "image", "image": _image(24, 40, 0)},
                                         {"type": "text", "text": "describe the image"}]}]
    out = pipe(text=chat, generate_kwargs={"max_new_tokens": 5, "do_sample": False}, return_full_text=False)
    inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    assert out[0]["generated_text"] == processor.post_process_image_text_to_text(expected)[0]


def test_a_processor_that_disagrees_with_its_model_is_rejected(tiny_tokenizer, tmp_path):
    model, _ = _model_and_processor("qformer", tiny_tokenizer)
    model.save_pretrained(tmp_path)
    make_processor(tiny_tokenizer).save_pretrained(tmp_path)  # merger geometry next to a Q-Former model
    with pytest.raises(ValueError, match="counts visual tokens as .*merger.* but the model there emits .*qformer"):
        vlmkit.VLMKitProcessor.from_pretrained(tmp_path)

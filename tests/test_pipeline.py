"""pipeline("image-text-to-text") end to end on a tiny random vlmkit model saved with its processor."""

import threading

import numpy as np
import pytest
import torch
from conftest import make_processor
from helpers import perturb_, tiny_vlmkit_config_for
from PIL import Image
from transformers import AutoProcessor, TextIteratorStreamer, pipeline

import vlmkit


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny_vlmkit")
    torch.manual_seed(0)
    model = perturb_(vlmkit.VLMKitForConditionalGeneration(tiny_vlmkit_config_for(tiny_tokenizer)), seed=3, scale=0.5)
    model.generation_config.eos_token_id = tiny_tokenizer.eos_token_id
    model.generation_config.pad_token_id = tiny_tokenizer.pad_token_id
    model.save_pretrained(path)
    make_processor(tiny_tokenizer).save_pretrained(path)
    return path


def _image(seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8))


def _expected(path, messages, max_new_tokens):
    """What generate() gives for the same chat, decoded: the pipeline must return exactly this."""
    model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path).eval()
    processor = vlmkit.VLMKitProcessor.from_pretrained(path)
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.post_process_image_text_to_text(out[:, inputs["input_ids"].shape[1]:])[0]


@pytest.mark.slow
def test_pipeline_chat_plain_video_batch_and_streaming(saved_model):
    assert type(AutoProcessor.from_pretrained(saved_model)) is vlmkit.VLMKitProcessor
    pipe = pipeline("image-text-to-text", model=str(saved_model))
    assert type(pipe.model) is vlmkit.VLMKitForConditionalGeneration
    assert type(pipe.processor) is vlmkit.VLMKitProcessor
    gen = {"max_new_tokens": 6, "do_sample": False}

    chat = [{"role": "user", "content": [{"type": "image", "image": _image(0)}, {"type": "text", "text": "describe the image"}]}]
    out = pipe(text=chat, generate_kwargs=gen, return_full_text=False)
    assert out[0]["generated_text"] == _expected(saved_model, chat, 6)
    assert len(out[0]["generated_text"]) > 0

    plain = pipe(images=_image(1), text="<|vision_start|><|image_pad|><|vision_end|>what is in this picture?",
                 generate_kwargs=gen, return_full_text=False)
    assert isinstance(plain[0]["generated_text"], str)

    frames = [_image(10 + i) for i in range(4)]
    video_chat = [{"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "what moves?"}]}]
    video_out = pipe(text=video_chat, generate_kwargs=gen, return_full_text=False)
    assert video_out[0]["generated_text"] == _expected(saved_model, video_chat, 6)

    other = [{"role": "user", "content": [{"type": "image", "image": _image(2)}, {"type": "image", "image": _image(3)},
                                          {"type": "text", "text": "how many shapes are there"}]}]
    batched = pipe(text=[chat, other], batch_size=2, generate_kwargs=gen, return_full_text=False)
    assert [b[0]["generated_text"] for b in batched] == [_expected(saved_model, chat, 6), _expected(saved_model, other, 6)]

    streamer = TextIteratorStreamer(pipe.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=pipe, kwargs=dict(text=chat, generate_kwargs={**gen, "streamer": streamer}))
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    assert streamed == out[0]["generated_text"]
    assert batched[0][0]["generated_text"] != batched[1][0]["generated_text"]

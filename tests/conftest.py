import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

import vlmkit  # noqa: E402
from helpers import EOS, PAD, reference_model  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def _load_ours(path, **kwargs):
    model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, **kwargs).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory):
    """(path, reference model) of a tiny, perturbed Qwen3-VL saved by transformers (untied)."""
    path = tmp_path_factory.mktemp("qwen3vl_untied")
    ref = reference_model(tie_word_embeddings=False)
    ref.save_pretrained(path)
    return path, ref


@pytest.fixture(scope="session")
def reference_checkpoint_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3vl_tied")
    ref = reference_model(tie_word_embeddings=True, seed=1)
    ref.save_pretrained(path)
    return path, ref


@pytest.fixture(scope="session")
def load_ours():
    return _load_ours


@pytest.fixture
def pair(reference_checkpoint):
    """(reference, ours) on the same weights, both fresh for each test."""
    path, _ = reference_checkpoint
    from transformers import Qwen3VLForConditionalGeneration

    ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    ref.generation_config.eos_token_id = EOS
    ref.generation_config.pad_token_id = PAD
    return ref, _load_ours(path)


CORPUS = [
    "describe the image please", "a cat sitting on a mat", "what is in this picture?", "hello world",
    "how many shapes are there", "a red circle and a blue square", "the video shows a moving star",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return vlmkit.build_tokenizer(CORPUS, vocab_size=300)


def make_processor(tokenizer, **image_kwargs):
    settings = dict(patch_size=4, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64, "longest_edge": 4096})
    settings.update(image_kwargs)
    image_processor = vlmkit.VLMKitImageProcessor(**settings)
    video_processor = vlmkit.VLMKitVideoProcessor(
        patch_size=settings["patch_size"], temporal_patch_size=2, merge_size=2,
        size={"shortest_edge": 64, "longest_edge": 8 * 4096},
    )
    return vlmkit.VLMKitProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


@pytest.fixture
def tiny_processor(tiny_tokenizer):
    return make_processor(tiny_tokenizer)

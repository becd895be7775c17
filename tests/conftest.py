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

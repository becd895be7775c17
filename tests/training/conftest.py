"""Fixtures of the training tests: one thread (tiny matrices run fastest, and two threads on a shared
two-core machine spin against each other), a tiny model with its processor."""

import pytest
import torch

from .training_testing import build


@pytest.fixture(autouse=True, scope="package")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def model_and_processor(tiny_tokenizer):
    return build(tiny_tokenizer)

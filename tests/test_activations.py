"""MLPActivation: in place only when no graph is recorded, and the same values either way."""

import pytest
import torch
from transformers.activations import ACT2FN

from vlmkit.modeling.activations import MLPActivation


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "silu", "relu"])
def test_values_equal_act2fn_and_in_place_only_without_graph(name):
    x = torch.randn(64, 48)
    expected = ACT2FN[name](x)
    act = MLPActivation(name)

    with torch.no_grad():
        buffer = x.clone()
        out = act(buffer)
    assert torch.equal(out, expected)
    # relu has no in-place entry: its input must stay as it was
    assert (out.data_ptr() == buffer.data_ptr()) == (name != "relu")

    leaf = x.clone().requires_grad_()
    hidden = leaf * 1.0  # a non-leaf that autograd needs for the activation's backward
    out = act(hidden)
    assert out.data_ptr() != hidden.data_ptr() and torch.equal(hidden, x)
    out.sum().backward()
    reference = x.clone().requires_grad_()
    ACT2FN[name](reference).sum().backward()
    assert torch.equal(leaf.grad, reference.grad)

"""per_sample_loss: every sample weighs the same, whatever its answer length."""

import math

import pytest
import torch
import torch.nn.functional as F

from vlmkit.training import IGNORE_INDEX, per_sample_loss


def _outputs(logits):
    return {"logits": logits}


def test_equals_mean_of_per_sample_token_means():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    labels = torch.full((3, 6), IGNORE_INDEX)
    labels[0, 2:6] = torch.tensor([1, 2, 3, 4])  # 4 learned targets (positions 1..4 predict them)
    labels[1, 5] = 7  # 1 learned target
    # row 2 learns nothing: it must not count
    loss = per_sample_loss(_outputs(logits), labels)
    row0 = F.cross_entropy(logits[0, 1:5], labels[0, 2:6])
    row1 = F.cross_entropy(logits[1, 4:5], labels[1, 5:6])
    assert loss.item() == pytest.approx(((row0 + row1) / 2).item(), abs=1e-6)
    token_mean = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    assert not math.isclose(loss.item(), token_mean.item(), abs_tol=1e-3)  # the weighting differs


def test_nothing_to_learn_gives_zero_with_gradient():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    loss = per_sample_loss(_outputs(logits), torch.full((2, 4), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None and logits.grad.abs().sum().item() == 0.0


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 5\)"):
        per_sample_loss(_outputs(torch.randn(2, 4, 5)), torch.zeros(2, 5, dtype=torch.long))

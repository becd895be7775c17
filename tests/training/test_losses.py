"""per_sample_loss: every sample weighs the same, whatever its answer length; per_answer_loss: every
assistant turn of a conversation does."""

import math

import pytest
import torch
import torch.nn.functional as F

from vlmkit.training import IGNORE_INDEX, per_answer_loss, per_sample_loss


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


def test_per_answer_loss_weighs_each_turn_equally():
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 11)
    labels = torch.full((2, 9), IGNORE_INDEX)
    labels[0, 1:4] = torch.tensor([1, 2, 3])  # a three-token answer
    labels[0, 6] = 4  # a one-token answer after an unlearned user turn
    labels[0, 8] = 5  # and another, ending the row
    labels[1, 0:2] = torch.tensor([6, 7])  # a row opening on labels: position 0 predicts nothing, so one token
    labels[1, 2] = IGNORE_INDEX
    labels[1, 3:5] = torch.tensor([8, 9])
    loss = per_answer_loss(_outputs(logits), labels)

    def ce(row, positions, targets):
        return F.cross_entropy(logits[row, positions], torch.tensor(targets))

    answers = [ce(0, [0, 1, 2], [1, 2, 3]), ce(0, [5], [4]), ce(0, [7], [5]), ce(1, [0], [7]), ce(1, [2, 3], [8, 9])]
    assert loss.item() == pytest.approx((sum(answers) / 5).item(), abs=1e-6)
    # one answer per row: the same as per_sample_loss
    single = labels.clone()
    single[0, 5:] = IGNORE_INDEX
    single[1, :3] = IGNORE_INDEX
    assert per_answer_loss(_outputs(logits), single).item() == pytest.approx(
        per_sample_loss(_outputs(logits), single).item(), abs=1e-6)


def test_per_answer_loss_nothing_to_learn_and_bad_shapes():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    loss = per_answer_loss(_outputs(logits), torch.full((2, 4), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum().item() == 0.0
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 5\)"):
        per_answer_loss(_outputs(torch.randn(2, 4, 5)), torch.zeros(2, 5, dtype=torch.long))

"""Loss weighting for `Trainer(compute_loss_func=...)`.

The model's own loss averages over every labelled token of the batch, so a sample counts in
proportion to its answer length: one 30-token caption outweighs ten one-word answers. When short,
exactly gradable answers ("3", "blue", "yes") carry the signal that teaches the model to look at
the image, `per_sample_loss` gives every sample the same weight instead: the mean over each sample's
labelled tokens, then the mean over the samples that have any. In a conversation of several answers
(a caption among one-word replies), `per_answer_loss` does the same one level down: every assistant
turn, one contiguous run of labels, weighs the same.

With gradient accumulation, train with `vlmkit.training.VLMKitTrainer`, or set
`trainer.loss_is_scaled_for_ga = False` on a plain `Trainer`: transformers takes a
`compute_loss_func`'s loss as already scaled over the accumulated batch (token losses summed over
`num_items_in_batch`), but these are per-micro-batch means, so left alone N micro-batches add up to
N times the batch's loss and gradient. Both functions declare it (`loss_is_scaled_for_ga = False`,
which `VLMKitTrainer` reads); told so, the Trainer divides each by N, and N micro-batches of equal
size give exactly one batch's mean (tests/training/test_trainer.py). Under DDP a plain `Trainer` also
multiplies them by the number of processes; `VLMKitTrainer` does not (training/trainer.py).
"""

import torch
import torch.nn.functional as F

from .collator import IGNORE_INDEX


def _token_losses(outputs, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S-1) cross-entropy of each position's next token, and (B, S-1) which of them are learned."""
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape[:2])} and labels {tuple(labels.shape)} must share (batch, seq)")
    targets = labels[:, 1:]  # (B, S-1): the token each position predicts
    token_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    return token_loss, targets != IGNORE_INDEX


def per_sample_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy averaged per sample, then over samples; for `Trainer(compute_loss_func=...)`.

    `labels` (B, S) are the unshifted labels the collator makes (-100 where nothing is learned);
    position s of the logits predicts labels[:, s + 1]. `num_items_in_batch` (the token count
    Trainer passes for gradient accumulation) is ignored: samples, not tokens, are weighted, so
    each micro-batch gives its own mean, which the Trainer must divide by the accumulation steps
    (`loss_is_scaled_for_ga = False`, see above; `VLMKitTrainer` does it).
    """
    token_loss, learned_tokens = _token_losses(outputs, labels)
    counts = learned_tokens.sum(dim=1)
    learned = counts > 0
    if not learned.any():
        return token_loss.sum() * 0.0  # keeps the graph (and DDP) intact on a batch with nothing to learn
    return (token_loss.sum(dim=1)[learned] / counts[learned]).mean()


def per_answer_loss(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy averaged per answer (each contiguous run of labelled tokens: one assistant turn
    and its <|im_end|>), then over all the batch's answers; for `Trainer(compute_loss_func=...)`.
    With one answer per sample it equals `per_sample_loss`. `num_items_in_batch` is ignored, as there."""
    token_loss, learned = _token_losses(outputs, labels)
    if not learned.any():
        return token_loss.sum() * 0.0
    # an answer starts where a learned token follows an unlearned one (or opens its row)
    starts = learned & ~F.pad(learned[:, :-1], (1, 0), value=False)
    answer = (starts.flatten().cumsum(0) * learned.flatten()) - 1  # (B*(S-1),): answer index, -1 where unlearned
    kept = answer >= 0
    losses = token_loss.flatten()[kept]
    num_answers = int(starts.sum())
    sums = losses.new_zeros(num_answers).index_add(0, answer[kept], losses)
    counts = losses.new_zeros(num_answers).index_add(0, answer[kept], torch.ones_like(losses))
    return (sums / counts).mean()


# each returns its micro-batch's own mean: the Trainer must divide by the accumulation steps
per_sample_loss.loss_is_scaled_for_ga = False
per_answer_loss.loss_is_scaled_for_ga = False

# by name, for command lines: "token" is the model's own loss (every answer token weighs the same)
LOSS_FUNCTIONS = {"token": None, "sample": per_sample_loss, "answer": per_answer_loss}

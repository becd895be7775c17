"""`VLMKitTrainer`: transformers' `Trainer`, told how vlmkit's loss functions scale under gradient
accumulation.

The Trainer takes a `compute_loss_func`'s loss as already scaled over the accumulated batch (token
losses summed, then divided by `num_items_in_batch`), and so never divides it by the accumulation
steps. `per_sample_loss` and `per_answer_loss` return each micro-batch's own mean instead; under a
plain `Trainer` with `gradient_accumulation_steps=N` they give N times the batch's loss and
gradient. They say so in an attribute, `loss_is_scaled_for_ga = False`, and this Trainer copies it
onto itself, so N equal micro-batches give exactly one batch's mean. A loss function without the
attribute keeps transformers' default; an explicit `trainer.loss_is_scaled_for_ga` set after init
still wins.
"""

import functools

from transformers import Trainer


def declared_ga_scaling(loss_func) -> bool | None:
    """What a loss function declares about its gradient-accumulation scaling (`loss_is_scaled_for_ga`),
    looking through `functools.partial`; None when it declares nothing."""
    while isinstance(loss_func, functools.partial):
        if hasattr(loss_func, "loss_is_scaled_for_ga"):
            break
        loss_func = loss_func.func
    return getattr(loss_func, "loss_is_scaled_for_ga", None)


class VLMKitTrainer(Trainer):
    """A `Trainer` whose `compute_loss_func` may declare `loss_is_scaled_for_ga` (see the module
    docstring); everything else is transformers' `Trainer` unchanged."""

    def __init__(self, *args, compute_loss_func=None, **kwargs):
        super().__init__(*args, compute_loss_func=compute_loss_func, **kwargs)
        declared = declared_ga_scaling(compute_loss_func)
        if declared is not None:
            self.loss_is_scaled_for_ga = declared

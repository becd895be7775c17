"""`VLMKitTrainer`: transformers' `Trainer`, told how vlmkit's loss functions scale under gradient
accumulation and over several processes.

The Trainer takes a `compute_loss_func`'s loss as already scaled over the accumulated batch (token
losses summed, then divided by `num_items_in_batch`), and so never divides it by the accumulation
steps. `per_sample_loss` and `per_answer_loss` return each micro-batch's own mean instead; under a
plain `Trainer` with `gradient_accumulation_steps=N` they give N times the batch's loss and
gradient. They say so in an attribute, `loss_is_scaled_for_ga = False`, and this Trainer copies it
onto itself, so N equal micro-batches give exactly one batch's mean. A loss function without the
attribute keeps transformers' default; an explicit `trainer.loss_is_scaled_for_ga` set after init
still wins.

The same assumption breaks data parallelism: with a token count in hand and
`average_tokens_across_devices` (the default), the Trainer multiplies a `compute_loss_func`'s loss by
the number of processes, so under DDP a per-process mean trains on P times the loss over P
processes. While `loss_is_scaled_for_ga` is False (a per-micro-batch mean), this Trainer withholds
the token count, which such losses ignore anyway (tests/training/test_finetune_example.py runs two
gloo processes).
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
    """A `Trainer` whose `compute_loss_func` may declare `loss_is_scaled_for_ga`, and which keeps a
    per-micro-batch mean loss unscaled by the processes (see the module docstring); everything else is
    transformers' `Trainer` unchanged."""

    def __init__(self, *args, compute_loss_func=None, **kwargs):
        super().__init__(*args, compute_loss_func=compute_loss_func, **kwargs)
        declared = declared_ga_scaling(compute_loss_func)
        if declared is not None:
            self.loss_is_scaled_for_ga = declared

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.compute_loss_func is not None and self.loss_is_scaled_for_ga is False:
            # A per-micro-batch mean ignores the token count, and with one the Trainer would multiply
            # the loss by the number of processes (`average_tokens_across_devices`, right for a sum
            # over the global token count): DDP already averages the processes' gradients.
            num_items_in_batch = None
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

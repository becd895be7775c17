"""MLP activations that run in place when nothing records a graph.

On CPU a fresh activation buffer of a few MB is new memory whose pages fault on first touch; the
vision tower's (P, intermediate) MLP activation is the largest buffer of a prefill. Without autograd
the activation can overwrite the matmul output it reads (the same kernel, so the same values).
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

_IN_PLACE = {
    "gelu": lambda x: torch.ops.aten.gelu_(x),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "silu": lambda x: nn.functional.silu(x, inplace=True),
}


def no_graph(x: torch.Tensor) -> bool:
    """True when x may be overwritten: autograd neither needs it nor tracks it."""
    return not (torch.is_grad_enabled() and x.requires_grad)


class MLPActivation(nn.Module):
    """`ACT2FN[name]`, applied in place to a buffer the caller owns when no graph is recorded."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.act = ACT2FN[name]
        self.in_place = _IN_PLACE.get(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place is not None and no_graph(x):
            return self.in_place(x)
        return self.act(x)

    def extra_repr(self) -> str:
        return self.name

"""Attention dispatch shared by both towers.

Every attention call goes through transformers' `ALL_ATTENTION_FUNCTIONS`, keyed by
`config._attn_implementation`, so eager, sdpa, flash_attention_2/3 and user-registered kernels
all work. `eager_attention_forward` is the fallback for "eager".
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested


def repeat_kv(states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, S, hd) -> (B, kv_heads * n_rep, S, hd) for grouped-query attention."""
    if n_rep == 1:
        return states
    b, kv_heads, s, hd = states.shape
    return states[:, :, None].expand(b, kv_heads, n_rep, s, hd).reshape(b, kv_heads * n_rep, s, hd)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention; softmax in float32. Returns ((B, S, heads, hd), weights)."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, heads, S_q, S_k)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, S_q, heads, hd)
    return out, weights


def attention_interface(config) -> Callable:
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


def is_flash_attention(config) -> bool:
    return is_flash_attention_requested(config)

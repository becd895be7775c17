"""The connector interface, its registry, and the padding/attention helpers the query connectors share.

A connector maps the packed vision features of one level (the last block, or a DeepStack block) to
language-model embeddings: `(P, D_vision)` patches in the processor's block-major order plus the
per-item `grid_thw` -> `(N, D_llm)` tokens, with N = sum(num_visual_tokens(grid)) from
`configuration.geometry` and, per item, raster order over its LLM grid (query connectors: slice by
slice, query by query). The vision tower builds one instance for the main output (`visual.merger`)
and one per DeepStack level (`visual.deepstack_merger_list`) through `build_connector`; nothing
outside this package branches on the connector kind.

The registry is prismatic-vlms' pattern (TRI-ML/prismatic-vlms prismatic/models/materialize.py),
keyed by typed `connector_type` values instead of parsed strings.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...configuration import VLMKitConnectorConfig
from ..attention import attention_interface, is_flash_attention

# Learned queries and latents start from normal(0, 0.02), as LAVIS does for BLIP-2. Never a constant:
# without position information the queries are symmetric, and equal queries stay equal in training.
QUERY_INIT_STD = 0.02

CONNECTORS: dict[str, type["VisionConnector"]] = {}


def register_connector(name: str):
    def wrap(cls):
        cls.connector_type = name
        CONNECTORS[name] = cls
        return cls

    return wrap


def build_connector(
    connector_type: str, vision_config, connector_config: VLMKitConnectorConfig | None = None, deepstack: bool = False
) -> "VisionConnector":
    """One connector instance; `deepstack=True` builds the variant that reads a DeepStack level."""
    if connector_type not in CONNECTORS:
        raise ValueError(f"unknown connector_type {connector_type!r}; choose one of {sorted(CONNECTORS)}")
    return CONNECTORS[connector_type](vision_config, connector_config or VLMKitConnectorConfig(), deepstack=deepstack)


class VisionConnector(nn.Module, ABC):
    """Vision features -> LLM embeddings. Subclasses take (vision_config, connector_config, deepstack)."""

    connector_type: ClassVar[str]
    # Names of nn.Parameters holding learned queries/latents; the model's _init_weights draws them
    # from normal(0, QUERY_INIT_STD), also when a checkpoint without them is loaded.
    learned_query_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(P, D_vision) packed patch features, (I, 3) patch grids -> (N, D_llm) tokens."""


def check_activation(connector_config, field: str) -> str:
    """The activation name in `connector_config.<field>`, or a ValueError naming the field and the choices."""
    name = getattr(connector_config, field)
    if name not in ACT2FN:
        raise ValueError(f"{field} {name!r} is not one of {sorted(ACT2FN)}")
    return name


def learned_queries(count: int, width: int) -> nn.Parameter:
    """(count, width) learned queries/latents drawn from normal(0, QUERY_INIT_STD)."""
    return nn.Parameter(torch.empty(count, width).normal_(0.0, QUERY_INIT_STD))


def pad_slices(features: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (P, D) -> padded (S, L, D) with S = temporal slices over all items (an image is one
    slice), L = the longest slice, and the key mask (S, L), True = a real patch."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])  # (S,)
    slices = features.split(lengths.tolist())
    padded = nn.utils.rnn.pad_sequence(slices, batch_first=True)  # (S, L, D)
    key_mask = torch.arange(padded.shape[1], device=features.device) < lengths.to(features.device)[:, None]
    return padded, key_mask


def additive_key_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """(S, L) bool, True = attend -> (S, 1, 1, L) additive mask (0 or dtype min), None if nothing is padded.

    The additive form is what eager, sdpa, flex and custom kernels all accept; None keeps an unpadded
    batch on the kernels' fast path and makes a lone item bit-identical to the unmasked computation.
    """
    if bool(key_mask.all()):
        return None
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return mask.masked_fill(~key_mask, torch.finfo(dtype).min)[:, None, None, :]


class ConnectorAttention(nn.Module):
    """Shared core of the query connectors' attention: (S, Q, H*hd) queries over (S, L, KV*hd) keys.

    Dispatches through ALL_ATTENTION_FUNCTIONS by the vision config's `_attn_implementation`. Flash
    kernels unpad keys assuming queries share their padding, which padded cross-attention breaks;
    under a flash setting the connectors run sdpa (the vision tower and LLM keep flash).
    """

    def __init__(self, attn_config, num_heads: int, head_dim: int, num_key_value_heads: int | None = None):
        super().__init__()
        self.attn_config = attn_config
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_key_value_groups = num_heads // (num_key_value_heads or num_heads)  # read by the kernels
        self.scaling = head_dim**-0.5
        self.is_causal = False
        self.attention_dropout = 0.0

    def attend(self, query, key, value, mask) -> torch.Tensor:
        """query (S, Q, H*hd), key/value (S, L, KV*hd), mask (S, 1, 1, L) or None -> (S, Q, H*hd)."""
        s, q_len, _ = query.shape
        query = query.view(s, q_len, -1, self.head_dim).transpose(1, 2)  # (S, H, Q, hd)
        key = key.view(s, key.shape[1], -1, self.head_dim).transpose(1, 2)  # (S, KV, L, hd)
        value = value.view(s, value.shape[1], -1, self.head_dim).transpose(1, 2)  # (S, KV, L, hd)
        if is_flash_attention(self.attn_config):
            kernel = ALL_ATTENTION_FUNCTIONS["sdpa"]
        else:
            kernel = attention_interface(self.attn_config)
        out, _ = kernel(self, query, key, value, attention_mask=mask, scaling=self.scaling, dropout=0.0,
                        is_causal=False)
        return out.reshape(s, q_len, -1)  # (S, Q, H, hd) -> (S, Q, H*hd)

"""The Idefics2 perceiver resampler as a connector.

Follows transformers src/transformers/models/idefics2/modeling_idefics2.py (`Idefics2Connector`,
`Idefics2PerceiverResampler`, `Idefics2PerceiverLayer`, `Idefics2PerceiverAttention`): a bias-free
SwiGLU `modality_projection` from the ViT width to the LLM width, learned latents, pre-norm layers
(RMSNorm on latents and context) whose grouped-query attention reads keys/values from
[context; latents], a SwiGLU MLP, and a final RMSNorm. The reference's final norm is `norm`; here
it is `final_norm`, so that a Qwen3-VL checkpoint's `merger.norm` never lands in it.

Each temporal slice of each item is resampled separately: S slices -> S x Q tokens, item by item,
slice by slice, latent by latent.
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..text import VLMKitRMSNorm
from .base import (
    ConnectorAttention,
    VisionConnector,
    additive_key_mask,
    check_activation,
    learned_queries,
    pad_slices,
    register_connector,
)

RMS_NORM_EPS = 1e-6


class SwiGLU(nn.Module):
    """Idefics2MLP: down(act(gate(x)) * up(x)), bias-free."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int, hidden_act: str):
        super().__init__()
        self.gate_proj = nn.Linear(in_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(in_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, out_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PerceiverAttention(ConnectorAttention):
    """Idefics2PerceiverAttention: latents query [context; latents], so they also see each other."""

    def __init__(self, attn_config, connector_config, width: int):
        heads, head_dim = connector_config.resampler_num_heads, connector_config.resampler_head_dim
        kv_heads = connector_config.resampler_num_key_value_heads
        super().__init__(attn_config, heads, head_dim, kv_heads)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        keys_in = torch.cat([context, latents], dim=1)  # (S, L+Q, D)
        return self.o_proj(self.attend(self.q_proj(latents), self.k_proj(keys_in), self.v_proj(keys_in), mask))


class PerceiverLayer(nn.Module):
    """Idefics2PerceiverLayer: pre-norm attention and SwiGLU MLP, each with a residual."""

    def __init__(self, attn_config, connector_config, width: int, intermediate_size: int):
        super().__init__()
        self.input_latents_norm = VLMKitRMSNorm(width, eps=RMS_NORM_EPS)
        self.input_context_norm = VLMKitRMSNorm(width, eps=RMS_NORM_EPS)
        self.self_attn = PerceiverAttention(attn_config, connector_config, width)
        self.post_attention_layernorm = VLMKitRMSNorm(width, eps=RMS_NORM_EPS)
        self.mlp = SwiGLU(width, intermediate_size, width, connector_config.resampler_hidden_act)

    def forward(self, latents, context, mask) -> torch.Tensor:
        latents = latents + self.self_attn(self.input_latents_norm(latents), self.input_context_norm(context), mask)
        return latents + self.mlp(self.post_attention_layernorm(latents))


@register_connector("resampler")
class PerceiverResamplerConnector(VisionConnector):
    """(P, D_vision) patches of S slices -> (S*Q, D_llm): Q learned latents resample each slice."""

    learned_query_names = ("latents",)

    def __init__(self, vision_config, connector_config, deepstack: bool = False):
        super().__init__()
        check_activation(connector_config, "resampler_hidden_act")
        width = vision_config.out_hidden_size
        intermediate = connector_config.resampler_intermediate_size or 4 * width
        self.modality_projection = SwiGLU(
            vision_config.hidden_size, intermediate, width, connector_config.resampler_hidden_act
        )
        self.latents = learned_queries(connector_config.num_latents, width)  # (Q, D_llm)
        self.layers = nn.ModuleList(
            [PerceiverLayer(vision_config, connector_config, width, intermediate)
             for _ in range(connector_config.resampler_depth)]
        )
        self.final_norm = VLMKitRMSNorm(width, eps=RMS_NORM_EPS)

    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        context, key_mask = pad_slices(self.modality_projection(features), grid_thw)  # (S, L, D_llm), (S, L)
        latents = self.latents.expand(context.shape[0], -1, -1)  # (S, Q, D_llm)
        # keys are [context; latents]: the latents are never padding
        key_mask = torch.cat([key_mask, key_mask.new_ones(latents.shape[:2])], dim=1)  # (S, L+Q)
        mask = additive_key_mask(key_mask, context.dtype)
        for layer in self.layers:
            latents = layer(latents, context, mask)
        return self.final_norm(latents).flatten(0, 1)  # (S, Q, D_llm) -> (S*Q, D_llm)

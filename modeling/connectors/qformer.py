"""BLIP-2's Querying Transformer (Q-Former) as a connector.

Follows transformers src/transformers/models/blip_2/modeling_blip_2.py (`Blip2QFormerModel`,
`Blip2QFormerLayer`, `Blip2QFormerMultiHeadAttention`) and the LAVIS original
(salesforce/LAVIS lavis/models/blip2_models/blip2.py, `Blip2Base.init_Qformer`): an input LayerNorm
on the ViT features (LAVIS' `ln_vision`), learned query tokens with an embedding LayerNorm, BERT
post-LN layers with self-attention over the queries and cross-attention to the image every
`cross_attention_frequency`-th layer (layers 0, 2, 4, ...), and `language_projection` to the LLM
width. No text input (InstructBLIP mode) and no dropout.

Each temporal slice of each item is attended separately: S slices -> S x Q tokens, item by item,
slice by slice, query by query.
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from .base import (
    ConnectorAttention,
    VisionConnector,
    additive_key_mask,
    check_activation,
    learned_queries,
    pad_slices,
    register_connector,
)

# BERT's LayerNorm eps inside the Q-Former (Blip2QFormerConfig.layer_norm_eps); 1e-6 on the ViT side
QFORMER_NORM_EPS = 1e-12
VISION_NORM_EPS = 1e-6


class QFormerAttention(ConnectorAttention):
    """Blip2QFormerMultiHeadAttention + Blip2QFormerSelfOutput: LayerNorm(dense(attention) + input)."""

    def __init__(self, attn_config, hidden_size: int, context_size: int, num_heads: int):
        super().__init__(attn_config, num_heads, hidden_size // num_heads)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(context_size, hidden_size)
        self.value = nn.Linear(context_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=QFORMER_NORM_EPS)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = self.attend(self.query(hidden), self.key(context), self.value(context), mask)  # (S, Q, Dq)
        return self.layer_norm(self.dense(out) + hidden)


class QFormerLayer(nn.Module):
    """Blip2QFormerLayer for queries only: self-attention, optional cross-attention, query FFN."""

    def __init__(self, attn_config, connector_config, context_size: int, layer_idx: int):
        super().__init__()
        width, heads = connector_config.qformer_hidden_size, connector_config.qformer_num_heads
        self.attention = QFormerAttention(attn_config, width, width, heads)
        self.crossattention = None
        if layer_idx % connector_config.cross_attention_frequency == 0:
            self.crossattention = QFormerAttention(attn_config, width, context_size, heads)
        self.intermediate = nn.Linear(width, connector_config.qformer_intermediate_size)
        self.act_fn = ACT2FN[connector_config.qformer_hidden_act]
        self.output = nn.Linear(connector_config.qformer_intermediate_size, width)
        self.output_norm = nn.LayerNorm(width, eps=QFORMER_NORM_EPS)

    def forward(self, queries, context, context_mask) -> torch.Tensor:
        x = self.attention(queries, queries, None)  # queries see each other, never the padding
        if self.crossattention is not None:
            x = self.crossattention(x, context, context_mask)
        return self.output_norm(self.output(self.act_fn(self.intermediate(x))) + x)


@register_connector("qformer")
class QFormerConnector(VisionConnector):
    """(P, D_vision) patches of S slices -> (S*Q, D_llm): Q learned queries read each slice."""

    learned_query_names = ("query_tokens",)

    def __init__(self, vision_config, connector_config, deepstack: bool = False):
        super().__init__()
        check_activation(connector_config, "qformer_hidden_act")
        width = connector_config.qformer_hidden_size
        self.ln_vision = nn.LayerNorm(vision_config.hidden_size, eps=VISION_NORM_EPS)
        self.query_tokens = learned_queries(connector_config.num_queries, width)  # (Q, Dq)
        self.layernorm = nn.LayerNorm(width, eps=QFORMER_NORM_EPS)
        self.layers = nn.ModuleList(
            [QFormerLayer(vision_config, connector_config, vision_config.hidden_size, i)
             for i in range(connector_config.qformer_num_layers)]
        )
        self.language_projection = nn.Linear(width, vision_config.out_hidden_size)

    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        context, key_mask = pad_slices(self.ln_vision(features), grid_thw)  # (S, L, D_vision), (S, L)
        mask = additive_key_mask(key_mask, context.dtype)
        queries = self.layernorm(self.query_tokens).expand(context.shape[0], -1, -1)  # (S, Q, Dq)
        for layer in self.layers:
            queries = layer(queries, context, mask)
        return self.language_projection(queries).flatten(0, 1)  # (S, Q, D_llm) -> (S*Q, D_llm)

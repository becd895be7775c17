"""The language model: a Qwen3-style decoder with interleaved M-RoPE and DeepStack injection.

Shapes: B batch, S sequence, H hidden, hd head_dim.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..configuration import VLMKitTextConfig
from .activations import MLPActivation, no_graph
from .attention import attention_interface
from .pretrained import VLMKitPreTrainedModel
from .rotary import VLMKitTextRotaryEmbedding, apply_text_rotary


class VLMKitRMSNorm(nn.Module):
    """RMSNorm in float32; the weight multiplies after casting back (Qwen3 convention)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused kernel
            return nn.functional.rms_norm(x, shape, self.weight, self.variance_epsilon)
        return self.weight * nn.functional.rms_norm(x.float(), shape, None, self.variance_epsilon).to(x.dtype)


class VLMKitTextAttention(nn.Module):
    """Causal GQA attention with per-head RMSNorm on q and k (before the rotary)."""

    def __init__(self, config: VLMKitTextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = VLMKitRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = VLMKitRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, position_embeddings, attention_mask, cache: Cache | None = None, **kwargs):
        batch, seq = x.shape[:2]
        heads_shape = (batch, seq, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads_shape)).transpose(1, 2)  # (B, heads, S, hd)
        k = self.k_norm(self.k_proj(x).view(heads_shape)).transpose(1, 2)  # (B, kv_heads, S, hd)
        v = self.v_proj(x).view(heads_shape).transpose(1, 2)
        q, k = apply_text_rotary(q, k, *position_embeddings)
        if cache is not None:  # keys are cached after rotation
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = attention_interface(self.config)(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(batch, seq, -1)), weights  # (B, S, heads, hd) -> (B, S, H)


class VLMKitTextMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config: VLMKitTextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = MLPActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.act_fn(self.gate_proj(x))  # may overwrite gate_proj's fresh output
        up = self.up_proj(x)
        return self.down_proj(gated.mul_(up) if no_graph(gated) and no_graph(up) else gated * up)


class VLMKitTextDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: VLMKitTextConfig, layer_idx: int):
        super().__init__()
        self.self_attn = VLMKitTextAttention(config, layer_idx)
        self.mlp = VLMKitTextMLP(config)
        self.input_layernorm = VLMKitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = VLMKitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache=cache, **kwargs
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def split_position_ids(position_ids: torch.Tensor | None, batch: int, seq: int, past: int, device):
    """Normalise position ids to (text row (B, S) or None, M-RoPE rows (3, B, S)).

    Accepted: None (arange after the cache), (B, S) text positions, (3, B, S) M-RoPE rows, or
    (4, B, S) = text row + M-RoPE rows. The text row only feeds the mask builder; without it,
    masking_utils could mistake M-RoPE jumps for packed-sequence boundaries.
    """
    if position_ids is None:
        position_ids = (torch.arange(seq, device=device) + past).view(1, 1, -1).expand(4, batch, -1)
    elif position_ids.ndim == 2:
        position_ids = position_ids[None].expand(4, -1, -1)
    if position_ids.ndim != 3 or position_ids.shape[0] not in (3, 4):
        raise ValueError(f"position_ids must be (B, S), (3, B, S) or (4, B, S), got {tuple(position_ids.shape)}")
    if position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    return None, position_ids


class VLMKitTextModel(VLMKitPreTrainedModel):
    """Decoder stack. Not purely textual: DeepStack adds visual features to the hidden states at the
    visual positions after each of the first len(deepstack_visual_embeds) layers."""

    config_class = VLMKitTextConfig
    config: VLMKitTextConfig
    input_modalities = ("text",)
    _can_record_outputs = {"hidden_states": VLMKitTextDecoderLayer, "attentions": VLMKitTextAttention}

    def __init__(self, config: VLMKitTextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [VLMKitTextDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = VLMKitRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = VLMKitTextRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        batch, seq = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        text_position_ids, mrope_position_ids = split_position_ids(position_ids, batch, seq, past, inputs_embeds.device)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=text_position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, mrope_position_ids)

        hidden_states = inputs_embeds
        num_deepstack = len(deepstack_visual_embeds) if deepstack_visual_embeds is not None else 0
        for layer_idx, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                position_embeddings,
                attention_mask=mask,
                position_ids=text_position_ids,
                cache=cache,
                **kwargs,
            )
            if layer_idx < num_deepstack:
                hidden_states = self._add_deepstack(hidden_states, visual_pos_masks, deepstack_visual_embeds[layer_idx])
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    @staticmethod
    def _add_deepstack(hidden_states, visual_pos_masks, visual_embeds):
        """hidden (B, S, H); mask (B, S) bool; visual_embeds (N, H) in the mask's flattened order."""
        hidden_states = hidden_states.clone()
        mask = visual_pos_masks.to(hidden_states.device)
        hidden_states[mask] = hidden_states[mask] + visual_embeds.to(hidden_states.device, hidden_states.dtype)
        return hidden_states

"""The vision tower: Conv3d patch embedding, interpolated learned positions, ViT blocks with 2D
rotary whose attention never crosses an image or a video's temporal slice, then the connector.

Shapes: P patches packed over all images/videos (no batch dim), D = vision hidden size,
N = language-model tokens after the connector.
"""

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .activations import MLPActivation
from .attention import attention_interface, is_flash_attention
from .connectors import build_connector
from .rotary import VLMKitVisionRotaryEmbedding, apply_vision_rotary
from .vision_geometry import attention_segments, check_grid_thw, patch_coordinates, position_table_taps


class VLMKitVisionPatchEmbed(nn.Module):
    """(P, C*T*p*p) flattened patches -> (P, D).

    The weight is a Conv3d's (checkpoint layout `patch_embed.proj.weight` (D, C, T, p, p)), but since
    stride equals kernel it is applied as one matmul over the flattened patch, whose feature order
    (C, T, p, p) is the kernel's: 2.5x faster forward and 4x faster backward than CPU conv3d, equal to
    it within float rounding (4e-6 on unit-scale fp32 activations).
    """

    def __init__(self, config):
        super().__init__()
        self.in_channels = config.in_channels
        self.kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.embed_dim = config.hidden_size
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=self.kernel, stride=self.kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patch_width = self.in_channels * self.kernel[0] * self.kernel[1] * self.kernel[2]
        if pixel_values.ndim != 2 or pixel_values.shape[-1] != patch_width:
            raise ValueError(
                f"pixel_values must have shape (num_patches, {patch_width}) = (patches, C*T*P*P), "
                f"got {tuple(pixel_values.shape)}"
            )
        weight = self.proj.weight.view(self.embed_dim, patch_width)  # (D, C, T, p, p) -> (D, C*T*p*p)
        return nn.functional.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VLMKitVisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = MLPActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))  # act_fn may overwrite fc1's fresh output


class VLMKitVisionAttention(nn.Module):
    """Bidirectional attention confined to each segment of `cu_seqlens`.

    Flash kernels get one varlen call; every other implementation runs once per segment, so the
    largest score tensor is (heads, L_i, L_i) for the largest single image or slice, never the total.
    sdpa, whose CPU and GPU kernels keep no score tensor, runs equal segments (same-size images, a
    video's slices) as one batched call instead.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.scaling = self.head_dim**-0.5
        self.num_key_value_groups = 1  # read by the eager kernel
        self.is_causal = False
        self.attention_dropout = 0.0
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x, cu_seqlens, max_seqlen, rotary, **kwargs) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).reshape(num_patches, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x (P, H, hd)
        q, k = apply_vision_rotary(q, k, *rotary)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, P, hd)
        attend = attention_interface(self.config)
        common = dict(attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False)
        if is_flash_attention(self.config):
            out, _ = attend(
                self, q, k, v, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                max_length_q=max_seqlen, max_length_k=max_seqlen, **common, **kwargs,
            )
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            if self.config._attn_implementation == "sdpa" and len(set(lengths)) == 1:
                segments = (t.view(self.num_heads, len(lengths), -1, self.head_dim).transpose(0, 1) for t in (q, k, v))
                out = attend(self, *segments, **common, **kwargs)[0]  # (segments, L, H, hd)
            else:
                chunks = zip(*(t.split(lengths, dim=2) for t in (q, k, v)))
                out = torch.cat([attend(self, qs, ks, vs, **common, **kwargs)[0] for qs, ks, vs in chunks], dim=1)
        return self.proj(out.reshape(num_patches, -1))  # (1, P, H, hd) -> (P, D)


class VLMKitVisionBlock(GradientCheckpointingLayer):
    def __init__(self, config):
        super().__init__()
        # eps is 1e-6 in Qwen3-VL, not PyTorch's 1e-5 default
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VLMKitVisionAttention(config)
        self.mlp = VLMKitVisionMLP(config)

    def forward(self, x, cu_seqlens, max_seqlen, rotary, **kwargs) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen, rotary, **kwargs)
        return x + self.mlp(self.norm2(x))


class VisionTowerOutput(dict):
    """Plain container: `embeds` (N, D_llm), `deepstack_embeds` list of (N, D_llm),
    `last_hidden_state` (P, D) and `llm_grid_thw` (items, 3)."""

    __getattr__ = dict.__getitem__


class VLMKitVisionTowerMixin:
    """Forward of the vision tower, shared by the standalone model class and the submodule."""

    def _build_tower(self, vision_config, connector_type: str, connector_config=None):
        cfg = vision_config
        self.spatial_merge_size = cfg.spatial_merge_size
        self.patch_embed = VLMKitVisionPatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.num_grid_per_side = int(round(cfg.num_position_embeddings**0.5))
        self.rotary_pos_emb = VLMKitVisionRotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([VLMKitVisionBlock(cfg) for _ in range(cfg.depth)])
        use_deepstack = connector_config is None or connector_config.use_deepstack
        self.deepstack_visual_indexes = list(cfg.deepstack_visual_indexes) if use_deepstack else []
        # Every connector lives at `merger` and `deepstack_merger_list`, where Qwen3-VL keeps its own:
        # one instance per DeepStack level, so every level has the main output's token count and order.
        self.merger = build_connector(connector_type, cfg, connector_config, deepstack=False)
        self.deepstack_merger_list = nn.ModuleList(
            build_connector(connector_type, cfg, connector_config, deepstack=True)
            for _ in self.deepstack_visual_indexes
        )

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> VisionTowerOutput:
        grid_thw = check_grid_thw(grid_thw, self.spatial_merge_size)
        num_patches = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
        if pixel_values.shape[0] != num_patches:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patch rows but the grids {grid_thw.tolist()} "
                f"describe {num_patches}"
            )
        cu_seqlens, max_seqlen = attention_segments(grid_thw)
        cu_seqlens = cu_seqlens.to(pixel_values.device)
        tap_idx, tap_wts = position_table_taps(grid_thw, self.num_grid_per_side, self.spatial_merge_size)
        coords = patch_coordinates(grid_thw, self.spatial_merge_size)

        x = self.patch_embed(pixel_values)  # (P, D)
        # float32 weights: the 4-tap sum happens in float32 and is cast afterwards
        pos = (self.pos_embed(tap_idx.to(x.device)) * tap_wts.to(x.device)[:, :, None]).sum(1)  # (P, D)
        x = x + pos.to(x.dtype)
        rotary = self.rotary_pos_emb(coords.to(x.device))

        deepstack_embeds = []
        for layer_idx, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, max_seqlen, rotary, **kwargs)
            if layer_idx in self.deepstack_visual_indexes:
                level = self.deepstack_visual_indexes.index(layer_idx)
                deepstack_embeds.append(self.deepstack_merger_list[level](x, grid_thw))
        return VisionTowerOutput(
            embeds=self.merger(x, grid_thw),
            deepstack_embeds=deepstack_embeds,
            last_hidden_state=x,
            grid_thw=grid_thw,
        )

"""Rotary position embeddings: 2D axial rotary for the vision tower, interleaved M-RoPE for the text.

Both modules keep `inv_freq` as a non-persistent buffer and follow transformers' naming contract
(`*RotaryEmbedding` with `config`, `rope_type`, `original_inv_freq` and a
`compute_<type>_rope_parameters` method) so that `from_pretrained`, which builds the model on the
meta device, recomputes the buffers instead of leaving them uninitialised.
"""

import torch
from torch import nn


def apply_vision_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (P, heads, hd) q/k by per-patch (P, 1, hd) float32 angles (cos and [-sin, sin], see
    apply_text_rotary), in float32, returned in the input dtype."""
    half = q.shape[-1] // 2
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + q32.roll(half, -1) * signed_sin
    k_out = k32 * cos + k32.roll(half, -1) * signed_sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def apply_text_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (B, heads, S, hd) q/k by (B, 1, S, hd) angles already in the model dtype.

    `x * cos + rotate_half(x) * sin` with rotate_half(x) = [-x2, x1] equals, bit for bit,
    `x * cos + roll(x) * [-sin, sin]`: one roll instead of chunk, neg and cat, with the signed sine
    computed once per forward and shared by every layer.
    """
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * signed_sin, k * cos + k.roll(half, -1) * signed_sin


class VLMKitVisionRotaryEmbedding(nn.Module):
    """2D rotary over (h, w) patch coordinates.

    head_dim/4 frequencies per axis: the angle vector is [h-freqs, w-freqs, h-freqs, w-freqs], so
    rotate_half pairs every dimension with one of the same axis and frequency.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type != "axial":
            raise ValueError(f"the vision tower supports only axial rope, got rope_type={self.rope_type!r}")
        inv_freq, self.attention_scaling = self.compute_axial_rope_parameters(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_axial_rope_parameters(config, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        axis_dim = (config.hidden_size // config.num_heads) // 2
        inv_freq = 1.0 / (base ** (torch.arange(0, axis_dim, 2, dtype=torch.float) / axis_dim))
        return inv_freq.to(device), 1.0

    def forward(self, patch_coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """patch_coords: (P, 2) long (h, w) -> cos, signed sin: (P, 1, head_dim) float32, ready to
        broadcast over heads (see apply_vision_rotary)."""
        freqs = patch_coords[..., None].float() * self.inv_freq.float()  # (P, 2, hd/4)
        freqs = freqs.flatten(1)[:, None]  # (P, 1, hd/2): [h | w]
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        # the angle vector is [freqs, freqs]: each half computed once
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


class VLMKitTextRotaryEmbedding(nn.Module):
    """Interleaved multimodal RoPE (Qwen3-VL).

    Positions come as three rows (t, h, w). Frequency i uses the t row by default; indices
    1, 4, 7, ... (< 3 * mrope_section[1]) use h and 2, 5, 8, ... (< 3 * mrope_section[2]) use w, so
    every axis spans low and high frequencies. For text tokens all rows are equal and this is plain
    1D RoPE.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type != "default":
            raise ValueError(f"M-RoPE supports rope_type 'default' only, got {self.rope_type!r}")
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
        self.mrope_section = config.mrope_section

    @staticmethod
    def compute_default_rope_parameters(config, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (3, B, S) -> cos, signed sin: (B, 1, S, head_dim) in x.dtype, ready to
        broadcast over heads (see apply_text_rotary)."""
        position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)  # (3, B, S, hd/2)
        freqs = self._interleave(freqs)[:, None]  # (B, 1, S, hd/2)
        cos, sin = freqs.cos(), freqs.sin()  # the angle vector is [freqs, freqs]: compute each once
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos = torch.cat([cos, cos], dim=-1).to(x.dtype)  # (B, 1, S, hd)
        signed_sin = torch.cat([-sin, sin], dim=-1).to(x.dtype)
        return cos, signed_sin

    def _interleave(self, freqs: torch.Tensor) -> torch.Tensor:
        out = freqs[0].clone()
        for axis in (1, 2):  # h, w overwrite every third frequency of the t row
            positions = slice(axis, 3 * self.mrope_section[axis], 3)
            out[..., positions] = freqs[axis, ..., positions]
        return out

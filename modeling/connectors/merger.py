"""Qwen3-VL's patch merger (transformers src/transformers/models/qwen3_vl/modeling_qwen3_vl.py,
`Qwen3VLVisionPatchMerger`), the default connector. Parameter names are the reference's, so
official checkpoints load into `visual.merger` and `visual.deepstack_merger_list.N` unchanged.
"""

import torch
from torch import nn

from .base import VisionConnector, register_connector


@register_connector("merger")
class PatchMergerConnector(VisionConnector):
    """Concatenate each m x m window of patches, then a 2-layer GELU MLP: (P, D) -> (P/m^2, D_llm).

    The main merger normalises each patch before the concat (LayerNorm(D)); the DeepStack mergers
    normalise after it (LayerNorm(m*m*D)). Both use exact-erf GELU, unlike the tanh GELU of the
    vision blocks. Block-major patch order makes the concat a plain view, and merge windows come out
    in raster order.
    """

    def __init__(self, vision_config, connector_config=None, deepstack: bool = False):
        super().__init__()
        self.merged_size = vision_config.hidden_size * vision_config.spatial_merge_size**2
        self.postshuffle_norm = deepstack
        self.norm = nn.LayerNorm(self.merged_size if deepstack else vision_config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, vision_config.out_hidden_size)

    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(features.view(-1, self.merged_size))  # (P/m^2, m^2*D)
        else:
            x = self.norm(features).view(-1, self.merged_size)  # (P, D) -> (P/m^2, m^2*D)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))

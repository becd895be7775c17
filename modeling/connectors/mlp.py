"""LLaVA-1.5's MLP projector, `mlp{N}x_gelu` (haotian-liu/LLaVA
llava/model/multimodal_projector/builder.py, `build_vision_projector`): one LLM token per patch.

`projector.0` is Linear(D_vision -> D_llm), followed by N-1 x (act, Linear(D_llm -> D_llm)), biases on
and no norm, with LLaVA's nn.Sequential indices (`mm_projector.0`, `.2`, ...).
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..vision_geometry import raster_order
from .base import VisionConnector, check_activation, register_connector


@register_connector("mlp")
class MLPConnector(VisionConnector):
    """(P, D_vision) -> (P, D_llm), re-ordered from the processor's merge-block order to raster order.

    M-RoPE positions, DeepStack masks and the placeholder scatter all assume each item's tokens run
    in raster order over its LLM grid (t, h, w); per-patch tokens inherit the block-major
    (h/m, w/m, m, m) order of the patches unless they are put back. DeepStack instances are the same
    module reading another vision block.
    """

    def __init__(self, vision_config, connector_config, deepstack: bool = False):
        super().__init__()
        act = check_activation(connector_config, "mlp_hidden_act")
        self.spatial_merge_size = vision_config.spatial_merge_size
        width = vision_config.out_hidden_size
        layers = [nn.Linear(vision_config.hidden_size, width)]
        for _ in range(connector_config.mlp_depth - 1):
            layers += [ACT2FN[act], nn.Linear(width, width)]
        self.projector = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        order = raster_order(grid_thw, self.spatial_merge_size).to(features.device)
        return self.projector(features[order])  # (P, D_vision) block-major -> (P, D_llm) raster

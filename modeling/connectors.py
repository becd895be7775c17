"""Vision-to-language connectors behind one interface and a registry.

A connector maps the packed vision features of one level (the last block, or a DeepStack block) to
language-model embeddings: `(P, D_vision)` patches in the processor's block-major order plus the
per-item `grid_thw` -> `(N, D_llm)` tokens, raster order over each item's LLM grid, with
N = sum(num_visual_tokens(grid)) from `configuration.geometry`. The vision tower builds one
instance for the main output (`visual.merger`) and one per DeepStack level
(`visual.deepstack_merger_list`); nothing outside this module branches on the connector kind.
"""

from abc import ABC, abstractmethod

import torch
from torch import nn

CONNECTORS: dict[str, type["VisionConnector"]] = {}


def register_connector(name: str):
    def wrap(cls):
        cls.connector_type = name
        CONNECTORS[name] = cls
        return cls

    return wrap


def build_connector(connector_type: str, vision_config, deepstack: bool) -> "VisionConnector":
    if connector_type not in CONNECTORS:
        raise ValueError(f"unknown connector_type {connector_type!r}; choose one of {sorted(CONNECTORS)}")
    return CONNECTORS[connector_type](vision_config, deepstack=deepstack)


class VisionConnector(nn.Module, ABC):
    connector_type: str

    @abstractmethod
    def forward(self, features: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(P, D_vision) packed patch features, (items, 3) grids -> (N, D_llm) tokens."""


@register_connector("merger")
class PatchMergerConnector(VisionConnector):
    """Qwen3-VL's 2x2 patch merger: concatenate each m x m window, then a 2-layer GELU MLP.

    The main merger normalises each patch before the concat (LayerNorm(D)); the DeepStack mergers
    normalise after it (LayerNorm(m*m*D)). Both use exact-erf GELU, unlike the tanh GELU of the
    vision blocks. Block-major patch order makes the concat a plain view, and merge windows come out
    in raster order.
    """

    def __init__(self, vision_config, deepstack: bool = False):
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

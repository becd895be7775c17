"""Configurations and the torch-free token geometry shared by the processor and the model."""

from .configuration_vlmkit import VLMKitConfig, VLMKitTextConfig, VLMKitVisionConfig
from .geometry import CONNECTOR_TYPES, llm_grid_thw, num_visual_tokens, tokens_per_temporal_slice

__all__ = [
    "CONNECTOR_TYPES",
    "VLMKitConfig",
    "VLMKitTextConfig",
    "VLMKitVisionConfig",
    "llm_grid_thw",
    "num_visual_tokens",
    "tokens_per_temporal_slice",
]

"""Configurations and the torch-free token geometry shared by the processor and the model."""

from .configuration_vlmkit import VLMKitConfig, VLMKitConnectorConfig, VLMKitTextConfig, VLMKitVisionConfig
from .geometry import (
    CONNECTOR_TYPES,
    MROPE_LAYOUTS,
    geometry_settings,
    llm_grid_thw,
    mrope_layout,
    num_visual_tokens,
    tokens_per_temporal_slice,
)

__all__ = [
    "CONNECTOR_TYPES",
    "MROPE_LAYOUTS",
    "VLMKitConfig",
    "VLMKitConnectorConfig",
    "VLMKitTextConfig",
    "VLMKitVisionConfig",
    "geometry_settings",
    "llm_grid_thw",
    "mrope_layout",
    "num_visual_tokens",
    "tokens_per_temporal_slice",
]

"""vlmkit model code: vision tower, connectors, text decoder, fusion and generation."""

from .connectors import CONNECTORS, VisionConnector, build_connector, register_connector
from .modeling_vlmkit import VLMKitForConditionalGeneration, VLMKitModel, VLMKitVisionModel, VLMKitVisualOutput
from .pretrained import VLMKitPreTrainedModel
from .text import VLMKitTextModel

__all__ = [
    "CONNECTORS",
    "VLMKitForConditionalGeneration",
    "VLMKitModel",
    "VLMKitPreTrainedModel",
    "VLMKitTextModel",
    "VLMKitVisionModel",
    "VLMKitVisualOutput",
    "VisionConnector",
    "build_connector",
    "register_connector",
]

"""vlmkit: a hackable Qwen3-VL-style vision-language model for Hugging Face Transformers.

Importing vlmkit registers model_type "vlmkit" with AutoConfig, AutoModel and
AutoModelForImageTextToText.
"""

from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

from .configuration import VLMKitConfig, VLMKitTextConfig, VLMKitVisionConfig
from .modeling import (
    VLMKitForConditionalGeneration,
    VLMKitModel,
    VLMKitPreTrainedModel,
    VLMKitTextModel,
    VLMKitVisionModel,
)

__version__ = "0.1.0"

AutoConfig.register(VLMKitConfig.model_type, VLMKitConfig, exist_ok=True)
AutoConfig.register(VLMKitVisionConfig.model_type, VLMKitVisionConfig, exist_ok=True)
AutoConfig.register(VLMKitTextConfig.model_type, VLMKitTextConfig, exist_ok=True)
AutoModel.register(VLMKitConfig, VLMKitModel, exist_ok=True)
AutoModel.register(VLMKitVisionConfig, VLMKitVisionModel, exist_ok=True)
AutoModel.register(VLMKitTextConfig, VLMKitTextModel, exist_ok=True)
AutoModelForImageTextToText.register(VLMKitConfig, VLMKitForConditionalGeneration, exist_ok=True)

__all__ = [
    "VLMKitConfig",
    "VLMKitForConditionalGeneration",
    "VLMKitModel",
    "VLMKitPreTrainedModel",
    "VLMKitTextConfig",
    "VLMKitTextModel",
    "VLMKitVisionConfig",
    "VLMKitVisionModel",
]

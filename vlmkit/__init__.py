"""vlmkit: a hackable Qwen3-VL-style vision-language model for Hugging Face Transformers.

Importing vlmkit registers model_type "vlmkit" with AutoConfig, AutoModel and
AutoModelForImageTextToText (and its sub-configurations with AutoConfig), and VLMKitProcessor,
VLMKitImageProcessor and VLMKitVideoProcessor with AutoProcessor, AutoImageProcessor and
AutoVideoProcessor.
"""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoVideoProcessor,
)

from .configuration import VLMKitConfig, VLMKitConnectorConfig, VLMKitTextConfig, VLMKitVisionConfig
from .modeling import (
    VLMKitForConditionalGeneration,
    VLMKitModel,
    VLMKitPreTrainedModel,
    VLMKitTextModel,
    VLMKitVisionModel,
)

from .processing import VLMKitImageProcessor, VLMKitProcessor, VLMKitVideoProcessor, build_tokenizer

from .cli import default_model_path

__version__ = "0.1.0"

AutoConfig.register(VLMKitConfig.model_type, VLMKitConfig, exist_ok=True)
AutoConfig.register(VLMKitVisionConfig.model_type, VLMKitVisionConfig, exist_ok=True)
AutoConfig.register(VLMKitTextConfig.model_type, VLMKitTextConfig, exist_ok=True)
AutoConfig.register(VLMKitConnectorConfig.model_type, VLMKitConnectorConfig, exist_ok=True)
AutoModel.register(VLMKitConfig, VLMKitModel, exist_ok=True)
AutoModel.register(VLMKitVisionConfig, VLMKitVisionModel, exist_ok=True)
AutoModel.register(VLMKitTextConfig, VLMKitTextModel, exist_ok=True)
AutoModelForImageTextToText.register(VLMKitConfig, VLMKitForConditionalGeneration, exist_ok=True)
# One class for both backends: vlmkit's image processor needs neither torchvision nor a fallback.
AutoImageProcessor.register(
    VLMKitConfig,
    image_processor_classes={"pil": VLMKitImageProcessor, "torchvision": VLMKitImageProcessor},
    exist_ok=True,
)
AutoProcessor.register(VLMKitConfig, VLMKitProcessor, exist_ok=True)
try:
    AutoVideoProcessor.register(VLMKitConfig, VLMKitVideoProcessor, exist_ok=True)
except (AttributeError, ImportError):  # transformers' video registry is a stub without torchvision
    pass

__all__ = [
    "VLMKitConfig",
    "VLMKitConnectorConfig",
    "VLMKitForConditionalGeneration",
    "VLMKitImageProcessor",
    "VLMKitModel",
    "VLMKitPreTrainedModel",
    "VLMKitProcessor",
    "VLMKitTextConfig",
    "VLMKitTextModel",
    "VLMKitVisionConfig",
    "VLMKitVideoProcessor",
    "VLMKitVisionModel",
    "build_tokenizer",
    "default_model_path",
]

"""Processing: image and video processors, the tokenizer builder, the chat template and the processor."""

from .chat_template import CHAT_TEMPLATE
from .image_processing_vlmkit import VLMKitImageProcessor, smart_resize
from .processing_vlmkit import VLMKitProcessor, frame_timestamps
from .tokenization import SPECIAL_TOKENS, build_tokenizer
from .video_processing_vlmkit import VLMKitVideoProcessor

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "VLMKitImageProcessor",
    "VLMKitProcessor",
    "VLMKitVideoProcessor",
    "build_tokenizer",
    "frame_timestamps",
    "smart_resize",
]

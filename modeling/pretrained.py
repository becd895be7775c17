"""The shared PreTrainedModel base: flags that let transformers pick attention kernels, shard,
checkpoint and load vlmkit models."""

from transformers.modeling_utils import PreTrainedModel

from ..configuration import VLMKitConfig


class VLMKitPreTrainedModel(PreTrainedModel):
    config_class = VLMKitConfig
    config: VLMKitConfig
    base_model_prefix = "model"
    input_modalities = ("image", "video", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["VLMKitTextDecoderLayer", "VLMKitVisionBlock"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False  # the vision tower loops over images in Python

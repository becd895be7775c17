"""The shared PreTrainedModel base: flags that let transformers pick attention kernels, shard,
checkpoint and load vlmkit models, and the initialisation of connector queries."""

from transformers import initialization as init
from transformers.modeling_utils import PreTrainedModel

from ..configuration import VLMKitConfig
from .connectors.base import QUERY_INIT_STD, VisionConnector


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

    def _init_weights(self, module):
        super()._init_weights(module)
        # Learned queries/latents are bare nn.Parameters the generic init does not know. They must
        # not be constant (BLIP-2's zeros, Idefics2's ones): equal queries never become different.
        # Runs for new models and for weights a checkpoint lacks (a Qwen3-VL checkpoint has none).
        if isinstance(module, VisionConnector):
            for name in module.learned_query_names:
                init.normal_(getattr(module, name), mean=0.0, std=QUERY_INIT_STD)

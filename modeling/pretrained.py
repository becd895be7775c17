"""The shared PreTrainedModel base: flags that let transformers pick attention kernels, shard,
checkpoint and load vlmkit models, the initialisation of connector queries, and the weight layout
that makes decoding fast."""

from fnmatch import fnmatch

from torch import nn
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

    # Linear layers (module-name patterns, fnmatch) whose weight is stored column-major; see `use_decode_layout`.
    _column_major_linears: tuple[str, ...] = ()

    def use_decode_layout(self) -> None:
        """Store the weights named in `_column_major_linears` column-major: the same logical (out, in)
        tensor, laid out as its transpose. A decode step multiplies one row per sequence by each
        weight, and on CPU that product is memory-bound: with the wide lm_head (8192 x 512) and the
        MLP's gate/up projections, BLAS runs it 1.2-4x faster over a column-major weight. Larger
        products (prefill, training) are indifferent to the layout, and saving writes the usual
        contiguous tensors. Called after `__init__` and after loading; layout never changes values.
        """
        # A weight tied to an embedding stays row-major: the embedding reads it row by row.
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and any(fnmatch(name, p) for p in self._column_major_linears):
                weight = module.weight
                # floating point only: quantized weights (int8, packed 4-bit) have their own layouts
                if (id(weight) not in embeddings and weight.dim() == 2 and weight.is_floating_point()
                        and weight.is_contiguous()):
                    weight.data = weight.data.t().contiguous().t()

    @classmethod
    def _finalize_model_loading(cls, model, load_config, loading_info):
        loading_info = super()._finalize_model_loading(model, load_config, loading_info)
        model.use_decode_layout()  # loading replaced the parameters with contiguous ones
        return loading_info

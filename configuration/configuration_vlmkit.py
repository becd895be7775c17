"""Configuration classes for vlmkit.

Field names and defaults follow transformers' Qwen3-VL configuration (so an official
`config.json` loads unchanged), plus the vlmkit-specific `connector_type` and `connector_config`.
This module imports no torch model code: the processor reads it too.
"""

import re
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging

from .geometry import CONNECTOR_TYPES, DEFAULT_NUM_LATENTS, DEFAULT_NUM_QUERIES, MROPE_LAYOUTS, geometry_settings

logger = logging.get_logger(__name__)

# model_type strings written by transformers (and by older hub files) for the same layout.
QWEN3_VL_MODEL_TYPES = ("qwen3_vl",)
QWEN3_VL_VISION_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_vision")
QWEN3_VL_TEXT_MODEL_TYPES = ("qwen3_vl_text",)


def _drop_foreign_model_type(sub_config: dict | PreTrainedConfig | None, accepted: tuple[str, ...]) -> None:
    """Official checkpoints carry their own sub-config `model_type`; ours is fixed by the class."""
    if isinstance(sub_config, dict) and sub_config.get("model_type") in accepted:
        sub_config.pop("model_type")


@strict
class VLMKitVisionConfig(PreTrainedConfig):
    r"""Vision tower: Conv3d patch embedding, learned position table, ViT blocks with 2D rotary.

    Defaults are those of Qwen3-VL-8B. `deepstack_visual_indexes` are 0-based block indices whose
    outputs feed the DeepStack connectors.
    """

    model_type = "vlmkit_vision"
    base_config_key = "vision_config"
    default_rope_type = "axial"
    attribute_map: ClassVar[dict[str, str]] = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] | tuple[int, ...] = (8, 16, 24)
    initializer_range: float = 0.02
    rope_parameters: dict | None = None

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        self.deepstack_visual_indexes = list(self.deepstack_visual_indexes)
        super().__post_init__(**kwargs)
        self.check_architecture()

    def check_architecture(self):
        """Raise ValueError (not the dataclass validator's wrapper) naming what is inconsistent."""
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings must be a square, got {self.num_position_embeddings}")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} fall outside the {self.depth} vision blocks")


@strict
class VLMKitTextConfig(PreTrainedConfig):
    r"""Language model: Qwen3-style decoder (GQA, per-head QK-norm, SwiGLU, RMSNorm) with interleaved
    M-RoPE. `rope_parameters["mrope_section"]` splits the head_dim/2 frequencies over (t, h, w)."""

    model_type = "vlmkit_text"
    base_config_key = "text_config"
    default_theta = 500000.0
    ignore_keys_at_rope_validation = {"mrope_section", "mrope_interleaved"}

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        self.check_architecture()

    @property
    def mrope_section(self) -> list[int]:
        return list((self.rope_parameters or {}).get("mrope_section", [24, 20, 20]))

    def check_architecture(self):
        """Raise ValueError (not the dataclass validator's wrapper) naming what is inconsistent."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2} "
                "(one entry per t, h, w frequency group)"
            )


@strict
class VLMKitConnectorConfig(PreTrainedConfig):
    r"""Hyperparameters of the vision-to-language connectors (all kinds; `VLMKitConfig.connector_type`
    picks the one that is built). Defaults are the references' (connectors_and_style.md, C.2):
    LLaVA-1.5 `mlp2x_gelu`, BLIP-2's Q-Former, Idefics2's perceiver resampler.

    Every connector works from the vision tower's width (`vision_config.hidden_size`) to the LLM
    width (`vision_config.out_hidden_size`); those are not repeated here.
    """

    model_type = "vlmkit_connector"
    base_config_key = "connector_config"

    use_deepstack: bool = True  # one extra connector instance per DeepStack level; False builds none
    mrope_layout: str | None = None  # None: the connector's own ("grid" merger/mlp, "sequence" qformer/resampler)
    query_grid: list[int] | tuple[int, ...] | None = None  # (gh, gw) virtual grid of the queries; None: most square

    # LLaVA-1.5 mlp{N}x_gelu: Linear(D_vision -> D_llm), then N-1 x (act, Linear(D_llm -> D_llm))
    mlp_depth: int = 2
    mlp_hidden_act: str = "gelu"

    # BLIP-2 Q-Former (bert-base sized): self-attention every layer, cross-attention every `frequency`-th
    num_queries: int = DEFAULT_NUM_QUERIES
    qformer_hidden_size: int = 768
    qformer_num_layers: int = 12
    qformer_num_heads: int = 12
    qformer_intermediate_size: int = 3072
    qformer_hidden_act: str = "gelu"
    cross_attention_frequency: int = 2

    # Idefics2 perceiver resampler, working at the LLM width with grouped-query attention
    num_latents: int = DEFAULT_NUM_LATENTS
    resampler_depth: int = 3
    resampler_num_heads: int = 16
    resampler_head_dim: int = 96
    resampler_num_key_value_heads: int = 4
    resampler_intermediate_size: int | None = None  # SwiGLU width of the projection and layers; None: 4 x D_llm
    resampler_hidden_act: str = "silu"

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)
        if self.query_grid is not None:
            self.query_grid = list(self.query_grid)
        super().__post_init__(**kwargs)
        self.check_architecture()

    def check_architecture(self):
        """Raise ValueError (not the dataclass validator's wrapper) naming what is inconsistent."""
        positive = ("mlp_depth", "num_queries", "qformer_hidden_size", "qformer_num_layers", "qformer_num_heads",
                    "qformer_intermediate_size", "cross_attention_frequency", "num_latents", "resampler_depth",
                    "resampler_num_heads", "resampler_head_dim", "resampler_num_key_value_heads")
        bad = {name: getattr(self, name) for name in positive if getattr(self, name) < 1}
        if bad:
            raise ValueError(f"connector settings must be at least 1: {bad}")
        if self.mrope_layout is not None and self.mrope_layout not in MROPE_LAYOUTS:
            raise ValueError(f"mrope_layout {self.mrope_layout!r} is not one of {list(MROPE_LAYOUTS)} (or None)")
        if self.query_grid is not None and (len(self.query_grid) != 2 or min(self.query_grid) < 1):
            raise ValueError(f"query_grid must be two positive numbers (gh, gw), got {self.query_grid}")
        if self.qformer_hidden_size % self.qformer_num_heads:
            raise ValueError(f"qformer_hidden_size {self.qformer_hidden_size} is not divisible by "
                             f"qformer_num_heads {self.qformer_num_heads}")
        if self.resampler_num_heads % self.resampler_num_key_value_heads:
            raise ValueError(f"resampler_num_heads {self.resampler_num_heads} is not a multiple of "
                             f"resampler_num_key_value_heads {self.resampler_num_key_value_heads}")


# LLaVA's projector names: "mlp2x_gelu" is the MLP connector of depth 2.
_LLAVA_MLP_ALIAS = re.compile(r"mlp(\d+)x_gelu")


@strict
class VLMKitConfig(PreTrainedConfig):
    r"""Top-level configuration: a vision tower, a connector and a language model.

    Reads official Qwen3-VL `config.json` files (current `rope_parameters` and the older
    `rope_scaling` + `rope_theta` form). `connector_type` picks the vision-to-language connector:
    "merger" (Qwen3-VL's 2x2 patch merger, its checkpoint layout), "mlp" (LLaVA-1.5; "mlp2x_gelu"
    is accepted as an alias), "qformer" (BLIP-2) or "resampler" (Idefics2 perceiver);
    `connector_config` holds their hyperparameters. A Qwen3-VL config has neither and reads as the
    merger with DeepStack.

    Loading a checkpoint with another connector: `from_pretrained(path, connector_type="qformer",
    connector_config={"num_queries": 16})` (the dict updates the checkpoint's connector settings).
    """

    model_type = "vlmkit"
    sub_configs_defaults = {
        "vision_config": VLMKitVisionConfig,
        "text_config": VLMKitTextConfig,
        "connector_config": VLMKitConnectorConfig,
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    connector_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    connector_type: str = "merger"

    def __post_init__(self, **kwargs):
        # A Qwen3-VL config.json says model_type "qwen3_vl"; loaded here it becomes a vlmkit config.
        kwargs.pop("model_type", None)
        _drop_foreign_model_type(self.vision_config, QWEN3_VL_VISION_MODEL_TYPES)
        _drop_foreign_model_type(self.text_config, QWEN3_VL_TEXT_MODEL_TYPES)
        alias = _LLAVA_MLP_ALIAS.fullmatch(self.connector_type)
        if alias:
            self.connector_type = "mlp"
        super().__post_init__(**kwargs)
        if alias:
            self.connector_config.mlp_depth = int(alias.group(1))
            self.connector_config.mlp_hidden_act = "gelu"
            self.connector_config.check_architecture()
        self.check_architecture()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # transformers applies loading kwargs with setattr on the finished config, which would skip
        # check_architecture and replace the connector settings wholesale; fold ours in beforehand.
        config_dict = dict(config_dict)
        if "connector_type" in kwargs:
            config_dict["connector_type"] = kwargs.pop("connector_type")
        if "connector_config" in kwargs:
            override = kwargs.pop("connector_config")
            current = config_dict.get("connector_config") or {}
            if isinstance(current, PreTrainedConfig):
                current = current.to_dict()
            config_dict["connector_config"] = override if isinstance(override, PreTrainedConfig) else {
                **current, **(override or {})
            }
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") in QWEN3_VL_MODEL_TYPES:
            # An official Qwen3-VL checkpoint: same layout, read as a vlmkit (merger) configuration.
            logger.info(f"reading the {config_dict['model_type']!r} config as a vlmkit configuration")
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def check_architecture(self):
        """Raise ValueError (not the dataclass validator's wrapper) naming what is inconsistent."""
        if self.connector_type not in CONNECTOR_TYPES:
            raise ValueError(f"connector_type {self.connector_type!r} is not one of {sorted(CONNECTOR_TYPES)}")
        geometry_settings(self)  # raises for a layout or query grid the connector cannot have

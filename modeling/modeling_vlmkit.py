"""vlmkit's model classes: the vision model, the multimodal base model and the generative head.

Data flow of `VLMKitModel.forward` (B batch, S sequence, H text hidden, N visual tokens):
  1. embed_tokens(input_ids)                                   -> (B, S, H)
  2. vision tower + connector per modality                      -> (N, H) + one (N, H) per DeepStack level
  3. scatter the visual tokens into the placeholder positions (counts checked)
  4. 3D positions per row from the attention mask              -> (4, B, S): text row + (t, h, w)
     (packed rows: per segment, from a text row restarting at 0 per sample; see packing.py)
  5. text decoder, DeepStack features added after its first layers

In training, a batch without pixels still runs the vision tower on a tiny blank image, times 0, when
any visual parameter trains, so DDP sees every parameter used on every rank.
"""

import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPooling, MultimodalCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import logging
from transformers.utils.deprecation import deprecate_kwarg

from ..configuration import VLMKitConfig, VLMKitConnectorConfig, VLMKitVisionConfig, llm_grid_thw, mrope_layout
from .attention import is_flash_attention
from .generation import ROPE_DELTAS_ATTR, VLMKitGenerationMixin, shift_by_cached_deltas
from .packing import flash_varlen_kwargs, is_packed, packed_position_ids
from .positions import multimodal_position_ids, text_positions, token_types_from_ids
from .pretrained import VLMKitPreTrainedModel
from .text import VLMKitTextModel
from .vision import VLMKitVisionTowerMixin
from .vision_geometry import check_grid_thw

logger = logging.get_logger(__name__)



@dataclass
class VLMKitVisualOutput(BaseModelOutputWithPooling):
    """`pooler_output`: tuple of (N_i, H) per image/video; `deepstack_features`: one such tuple per
    DeepStack level (None without DeepStack); `last_hidden_state`: (P, D) pre-connector patches."""

    deepstack_features: list[tuple[torch.Tensor, ...]] | None = None


class VLMKitVisionModel(VLMKitPreTrainedModel, VLMKitVisionTowerMixin):
    """Vision tower plus connector: (P, C*T*p*p) pixels and (items, 3) grids -> LLM-width tokens."""

    config_class = VLMKitVisionConfig
    config: VLMKitVisionConfig
    input_modalities = ("image", "video")
    main_input_name = "pixel_values"

    def __init__(
        self,
        config: VLMKitVisionConfig,
        connector_type: str = "merger",
        connector_config: VLMKitConnectorConfig | None = None,
    ):
        super().__init__(config)
        self._build_tower(config, connector_type, connector_config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        # The patch embedding plays the role of the input embedding: PEFT and gradient
        # checkpointing hook it so that the vision tower's inputs can require grad.
        return self.patch_embed

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> VLMKitVisualOutput:
        out = self.encode(pixel_values, grid_thw, **kwargs)
        return VLMKitVisualOutput(
            last_hidden_state=out.last_hidden_state,
            pooler_output=out.embeds,
            deepstack_features=out.deepstack_embeds or None,
        )


class VLMKitModel(VLMKitPreTrainedModel):
    """Vision tower + connector + language model, without the LM head."""

    def __init__(self, config: VLMKitConfig):
        super().__init__(config)
        self.visual = VLMKitVisionModel(
            config.vision_config, connector_type=config.connector_type, connector_config=config.connector_config
        )
        self.language_model = VLMKitTextModel(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.embed_tokens = value

    # ----------------------------------------------------------------------------------- vision
    def llm_grids(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """(items, 3) patch grids -> (items, 3) LLM token grids, via the shared geometry function."""
        return torch.tensor([llm_grid_thw(g, self.config) for g in grid_thw.tolist()], dtype=torch.long)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None, **kwargs):
        """Encode images; features come back split per image (and per DeepStack level)."""
        if image_grid_thw is None:
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)} were given without image_grid_thw; pass the "
                "(num_images, 3) grid the processor returned"
            )
        return self._encode_visual(pixel_values, image_grid_thw, "image_grid_thw", **kwargs)

    def get_video_features(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor | None = None, **kwargs):
        if video_grid_thw is None:
            raise ValueError(
                f"pixel_values_videos of shape {tuple(pixel_values_videos.shape)} were given without video_grid_thw; "
                "pass the (num_videos, 3) grid the processor returned"
            )
        return self._encode_visual(pixel_values_videos, video_grid_thw, "video_grid_thw", **kwargs)

    def _encode_visual(self, pixel_values, grid_thw, grid_name: str, **kwargs) -> VLMKitVisualOutput:
        kwargs.pop("return_dict", None)
        grid_thw = check_grid_thw(grid_thw, self.config.vision_config.spatial_merge_size, grid_name)
        out = self.visual(pixel_values.to(self.visual.dtype), grid_thw, **kwargs)
        sizes = self.llm_grids(grid_thw).prod(-1).tolist()
        if out.pooler_output.shape[0] != sum(sizes):
            raise ValueError(
                f"the {self.config.connector_type} connector returned {out.pooler_output.shape[0]} tokens for "
                f"{grid_name} {grid_thw.tolist()}, but the token geometry gives {sum(sizes)} ({sizes} per item)"
            )
        out.pooler_output = torch.split(out.pooler_output, sizes)
        if out.deepstack_features is not None:
            out.deepstack_features = [torch.split(level, sizes) for level in out.deepstack_features]
        return out

    def placeholder_mask(self, input_ids, inputs_embeds, token_id: int, mm_token_type_ids=None) -> torch.Tensor:
        """(B, S) bool mask of one modality's placeholders: from ids, else from mm_token_type_ids (so
        embeddings that already hold merged features still locate them), else from embeddings."""
        if input_ids is not None:
            return input_ids == token_id
        if mm_token_type_ids is not None:
            kind = 1 if token_id == self.config.image_token_id else 2
            return (mm_token_type_ids == kind).to(inputs_embeds.device)
        token_embed = self.get_input_embeddings()(torch.tensor(token_id, device=inputs_embeds.device))
        return (inputs_embeds == token_embed).all(-1)

    def _scatter_visual(self, inputs_embeds, mask, encoded: VLMKitVisualOutput, name: str):
        features = torch.cat(list(encoded.pooler_output), dim=0)
        n_tokens, n_features = int(mask.sum()), features.shape[0]
        if n_tokens != n_features:
            per_item = [f.shape[0] for f in encoded.pooler_output]
            raise ValueError(
                f"{name} features and {name} placeholder tokens do not match: input holds {n_tokens} {name} "
                f"tokens but the {len(per_item)} {name}(s) give {n_features} features ({per_item} per {name}). "
                f"Build the prompt with the vlmkit processor so each {name} gets exactly its tokens."
            )
        features = features.to(inputs_embeds.device, inputs_embeds.dtype)
        return inputs_embeds.masked_scatter(mask[..., None].expand_as(inputs_embeds), features)

    @staticmethod
    def _joint_deepstack(image_mask, video_mask, image_out, video_out):
        """Merge per-modality DeepStack features into one (N_visual, H) tensor per level, ordered by
        position in the (B, S) sequence, with the union mask they belong to."""
        levels = []
        outs = [(m, o) for m, o in ((image_mask, image_out), (video_mask, video_out)) if m is not None and o is not None]
        outs = [(m, o) for m, o in outs if o.deepstack_features is not None]
        if not outs:
            return None, None
        visual_mask = outs[0][0].clone()
        for m, _ in outs[1:]:
            visual_mask |= m
        for level in range(len(outs[0][1].deepstack_features)):
            first = torch.cat(list(outs[0][1].deepstack_features[level]))
            joint = first.new_zeros(int(visual_mask.sum()), first.shape[-1])
            for m, o in outs:
                joint[m[visual_mask]] = torch.cat(list(o.deepstack_features[level])).to(joint.dtype)
            levels.append(joint)
        return visual_mask, levels

    # -------------------------------------------------------------------------------- positions
    def mrope_position_ids(self, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask):
        """(3, B, S) M-RoPE positions and (B, 1) rope deltas, laid out as the connector's geometry says."""
        return multimodal_position_ids(
            mm_token_type_ids,
            self.llm_grids(image_grid_thw) if image_grid_thw is not None else None,
            self.llm_grids(video_grid_thw) if video_grid_thw is not None else None,
            attention_mask,
            layout=mrope_layout(self.config),
        )

    def compute_position_ids(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        """(4, B, S) positions: row 0 sequential text positions (for the mask), rows 1-3 M-RoPE."""
        batch, seq = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        past = cache.get_seq_length() if cache is not None else 0
        text = text_positions(attention_mask, batch, seq, past, device)
        has_grids = image_grid_thw is not None or video_grid_thw is not None
        if past == 0 and has_grids and (input_ids is not None or mm_token_type_ids is not None):
            types = mm_token_type_ids
            if types is None:
                types = token_types_from_ids(input_ids, self.config.image_token_id, self.config.video_token_id)
            mrope, _ = self.mrope_position_ids(
                types,
                image_grid_thw,
                video_grid_thw,
                attention_mask if attention_mask is not None and attention_mask.ndim == 2 else None,
            )
            mrope = mrope.to(device)
        else:
            mrope = shift_by_cached_deltas(text, cache if past > 0 else None)[None].expand(3, -1, -1)
        return torch.cat([text[None], mrope], dim=0)

    def _packed_inputs(self, attention_mask, position_ids, input_ids, mm_token_type_ids, image_grid_thw,
                       video_grid_thw, cache, past: int, kwargs: dict):
        """Packed rows (several samples per row, no padding): position ids whose text row restarts at 0
        where each sample begins (modeling/packing.py). Returns (attention_mask, position_ids).

        A (B, S) text row without padding gets its M-RoPE rows computed per segment; packed rows drop an
        all-ones mask and run without a cache, so the mask builder confines attention to each segment
        (flash kernels get the segments' cu_seq_lens). Padded inputs and cached continuations pass through.
        """
        if position_ids is None or past > 0 or position_ids.ndim not in (2, 3):
            return attention_mask, position_ids
        if attention_mask is not None and not (attention_mask.ndim == 2 and bool(attention_mask.all())):
            return attention_mask, position_ids
        text_row = position_ids if position_ids.ndim == 2 else position_ids[0] if position_ids.shape[0] == 4 else None
        if text_row is not None and is_packed(text_row):
            if cache is not None or kwargs.get("use_cache"):
                raise ValueError(
                    "packed inputs (position ids restarting at 0 per sample) cannot be cached: pass use_cache=False "
                    "and no cache, or one sample per row with an attention mask"
                )
            attention_mask = None
            kwargs["use_cache"] = False
            if is_flash_attention(self.language_model.config) and "cu_seq_lens_q" not in kwargs:
                kwargs.update(flash_varlen_kwargs(text_row))
        if position_ids.ndim == 2 and (image_grid_thw is not None or video_grid_thw is not None):
            types = mm_token_type_ids
            if types is None and input_ids is not None:
                types = token_types_from_ids(input_ids, self.config.image_token_id, self.config.video_token_id)
            if types is not None:
                position_ids = packed_position_ids(
                    position_ids,
                    types,
                    self.llm_grids(image_grid_thw) if image_grid_thw is not None else None,
                    self.llm_grids(video_grid_thw) if video_grid_thw is not None else None,
                    layout=mrope_layout(self.config),
                )
        return attention_mask, position_ids

    # ------------------------------------------------------------------------------- training
    def _visual_trains(self) -> bool:
        return any(p.requires_grad for p in self.visual.parameters())

    def _unused_visual_term(self, like: torch.Tensor) -> torch.Tensor:
        """0 * (the outputs of the vision tower, connector and DeepStack mergers on one tiny blank image).

        A training batch without pixels would leave a trainable vision tower or connector out of the
        graph; DDP then fails ("Expected to have finished reduction") or waits for gradients one rank
        never produces. Adding this zero keeps every visual parameter in every rank's graph with a
        zero gradient, and leaves the loss and the other gradients unchanged.
        """
        vision = self.config.vision_config
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        grid = torch.tensor([[1, merge, merge]])
        pixels = torch.zeros(merge * merge, width, device=self.visual.device, dtype=self.visual.dtype)  # (m*m, C*T*P*P)
        out = self.visual(pixels, grid)
        total = out.pooler_output.sum()
        for level in out.deepstack_features or []:
            total = total + level.sum()
        return (total * 0).to(like.device, like.dtype)

    # ---------------------------------------------------------------------------------- forward
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        mm_encoder_outputs: dict | None = None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)

        encoded = dict(mm_encoder_outputs or {})
        for name, pixels, grid, encode in (
            ("image", pixel_values, image_grid_thw, self.get_image_features),
            ("video", pixel_values_videos, video_grid_thw, self.get_video_features),
        ):
            if pixels is None:
                continue
            if encoded.get(name) is not None:
                raise ValueError(f"pass either {name} pixels or precomputed mm_encoder_outputs[{name!r}], not both")
            encoded[name] = encode(pixels, grid)

        past = cache.get_seq_length() if cache is not None else 0
        masks = {}
        for name, token_id in (("image", self.config.image_token_id), ("video", self.config.video_token_id)):
            if encoded.get(name) is None and past > 0:
                continue  # a decode step: no media to place, nothing to check
            mask = self.placeholder_mask(input_ids, inputs_embeds, token_id, mm_token_type_ids)
            if encoded.get(name) is not None:
                inputs_embeds = self._scatter_visual(inputs_embeds, mask, encoded[name], name)
                masks[name] = mask
            elif past == 0 and bool(mask.any()):
                raise ValueError(
                    f"input holds {int(mask.sum())} {name} placeholder tokens but no {name} pixels were given "
                    f"(pass pixel_values{'' if name == 'image' else '_videos'} and {name}_grid_thw)"
                )

        visual_pos_masks, deepstack_embeds = self._joint_deepstack(
            masks.get("image"), masks.get("video"), encoded.get("image"), encoded.get("video")
        )
        if self.training and all(v is None for v in encoded.values()) and self._visual_trains():
            inputs_embeds = inputs_embeds + self._unused_visual_term(inputs_embeds)

        attention_mask, position_ids = self._packed_inputs(
            attention_mask, position_ids, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, cache, past,
            kwargs,
        )
        if self.training and cache is None and kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False  # a training forward has no use for a DynamicCache

        if position_ids is None:
            position_ids = self.compute_position_ids(
                input_ids, inputs_embeds, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw, cache
            )
        if cache is not None and position_ids.ndim == 3 and position_ids.shape[0] == 4 and (past == 0 or encoded):
            # The last token is text (all rows equal), so its M-RoPE minus text position is the delta a
            # later continuation of this cache starts from. Decode steps leave it unchanged.
            setattr(cache, ROPE_DELTAS_ATTR, (position_ids[1, :, -1:] - position_ids[0, :, -1:]).detach())

        outputs = self.language_model(
            input_ids=None,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack_embeds,
            **kwargs,
        )
        outputs.image_outputs = encoded.get("image")
        outputs.video_outputs = encoded.get("video")
        return outputs


class VLMKitForConditionalGeneration(VLMKitPreTrainedModel, VLMKitGenerationMixin):
    """VLMKitModel plus the LM head, loss and the generation glue for multimodal inputs."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    # Trainer passes num_items_in_batch, so the loss is token-weighted under gradient accumulation.
    accepts_loss_kwargs = True
    _column_major_linears = ("lm_head", "model.language_model.layers.*.mlp.gate_proj",
                             "model.language_model.layers.*.mlp.up_proj")

    def __init__(self, config: VLMKitConfig):
        super().__init__(config)
        self.model = VLMKitModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()
        self.use_decode_layout()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
        return self.model.get_video_features(pixel_values_videos, video_grid_thw, **kwargs)

    @property
    def visual(self) -> VLMKitVisionModel:
        return self.model.visual

    @property
    def language_model(self) -> VLMKitTextModel:
        return self.model.language_model

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> MultimodalCausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
            mm_encoder_outputs=mm_encoder_outputs,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits,
                labels=labels,
                vocab_size=self.config.text_config.vocab_size,
                num_items_in_batch=num_items_in_batch,
            )
        return MultimodalCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            image_outputs=outputs.image_outputs,
            video_outputs=outputs.video_outputs,
        )

    # ---------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, *args, allow_missing_weights: bool = False, **kwargs):
        """`PreTrainedModel.from_pretrained`, but a checkpoint that lacks any weight of the model
        raises instead of leaving that weight randomly initialised. Pass
        `allow_missing_weights=True` to accept new, randomly initialised weights deliberately.

        One case is deliberate by construction: a configuration whose connector differs from the
        checkpoint's (`from_pretrained(qwen3_vl_path, connector_type="qformer", connector_config={...})`,
        or `config=`). Then the connector weights (`model.visual.merger.*`,
        `model.visual.deepstack_merger_list.*`) are new and logged as such; anything else missing raises.
        """
        return _strict_from_pretrained(super().from_pretrained, allow_missing_weights, *args, **kwargs)


# This class's connector weights: the main instance and its DeepStack instances, for every connector kind.
_CONNECTOR_WEIGHT = re.compile(r"^model\.visual\.(merger|deepstack_merger_list)\.")
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def _connector_signature(config: VLMKitConfig) -> tuple:
    """What decides the connector's weights: its kind and its settings."""
    settings = {name: getattr(config.connector_config, name) for name in VLMKitConnectorConfig.__annotations__}
    return config.connector_type, settings


def _saved_connector(args, kwargs) -> tuple | None:
    """The connector signature of the checkpoint's own config.json (Qwen3-VL: the merger), if readable."""
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if path is None:
        return None
    try:
        saved = VLMKitConfig.from_pretrained(path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    except (OSError, ValueError):
        return None
    return _connector_signature(saved)


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


def _strict_from_pretrained(load, allow_missing: bool, *args, **kwargs):
    want_info = kwargs.pop("output_loading_info", False)
    model, info = load(*args, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys", []))
    saved = _saved_connector(args, kwargs) if missing else None
    if saved is not None and saved != _connector_signature(model.config):
        new = [k for k in missing if _CONNECTOR_WEIGHT.match(k)]
        unused = sorted(k for k in info.get("unexpected_keys", []) if _CONNECTOR_WEIGHT.match(k))
        missing = [k for k in missing if not _CONNECTOR_WEIGHT.match(k)]
        if new:
            logger.warning(
                f"the checkpoint's connector is {saved[0]!r}, this model's is {model.config.connector_type!r}: "
                f"{len(new)} connector weight(s) are new and start from their initialisation: {_shown(new)}. "
                f"{len(unused)} checkpoint connector weight(s) are not used: {_shown(unused) or 'none'}. "
                "from_pretrained(..., output_loading_info=True) returns the full lists."
            )
    if missing and not allow_missing:
        raise ValueError(
            f"the checkpoint does not contain {len(missing)} weight(s) of {type(model).__name__}: {_shown(missing)}. "
            "They would be left randomly initialised; pass allow_missing_weights=True if that is intended."
        )
    return (model, info) if want_info else model

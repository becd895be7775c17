"""VLMKitProcessor: tokenizer + image processor + video processor + chat template.

It turns text with `<|image_pad|>` / `<|video_pad|>` placeholders plus the media into model inputs:
each image placeholder becomes exactly `num_visual_tokens(grid)` image tokens (the shared geometry
function in `vlmkit.configuration`, so it always equals what the model's connector emits), each
video placeholder becomes one `<t seconds><|vision_start|>...<|vision_end|>` block per temporal
slice, as Qwen3-VL 5.24 writes it. Everything is checked before the model runs: images versus
placeholders per sample, and truncation that would cut a vision span.
"""

import json
import os
import re
from typing import Any

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import logging

from ..configuration.geometry import geometry_settings, num_visual_tokens, tokens_per_temporal_slice
from .chat_template import CHAT_TEMPLATE
from .image_processing_vlmkit import VLMKitImageProcessor
from .video_processing_vlmkit import DEFAULT_SOURCE_FPS, VLMKitVideoProcessor

logger = logging.get_logger(__name__)

TEXT_KWARGS = {"padding", "truncation", "max_length", "padding_side", "add_special_tokens", "pad_to_multiple_of",
               "return_attention_mask", "return_offsets_mapping"}
IGNORED_KWARGS = {"return_token_type_ids", "return_mm_token_type_ids", "return_text_replacement_offsets",
                  "sanitize_control_tokens"}
VIDEO_ONLY_KWARGS = {"fps", "num_frames", "do_sample_frames", "video_metadata", "min_frames", "max_frames",
                     "return_metadata"}


def frame_timestamps(indices: list[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal slice: frame indices padded like the frames (last one repeated),
    converted with fps, and averaged over each slice's first and last frame (Qwen3-VL)."""
    indices = list(indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def _is_nested(items) -> bool:
    return isinstance(items, (list, tuple)) and len(items) > 0 and all(isinstance(x, (list, tuple)) for x in items)


class VLMKitProcessor(ProcessorMixin):
    r"""Processor for vlmkit models.

    Args:
        image_processor (`VLMKitImageProcessor`), tokenizer, video_processor (`VLMKitVideoProcessor`),
        chat_template (`str`, defaults to vlmkit's ChatML template with generation markers),
        geometry (`dict`): how many tokens a patch grid becomes, as
            `vlmkit.configuration.geometry_settings(model.config)` gives it; defaults to the
            Qwen3-VL merger with the image processor's merge size.
    """

    valid_processor_kwargs = None  # __call__ routes its own keyword arguments

    def __init__(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None,
                 geometry: dict | None = None, **kwargs):
        image_processor = image_processor if image_processor is not None else VLMKitImageProcessor()
        if video_processor is None:
            video_processor = VLMKitVideoProcessor(
                patch_size=image_processor.patch_size, merge_size=image_processor.merge_size,
                temporal_patch_size=image_processor.temporal_patch_size,
                image_mean=image_processor.image_mean, image_std=image_processor.image_std,
            )
        super().__init__(image_processor, tokenizer, video_processor,
                         chat_template=chat_template if chat_template is not None else CHAT_TEMPLATE)
        self.geometry = dict(geometry) if geometry else {
            "connector_type": "merger", "spatial_merge_size": image_processor.merge_size,
        }
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        ids = tokenizer.convert_tokens_to_ids(
            [self.image_token, self.video_token, self.vision_start_token, self.vision_end_token]
        )
        unknown = [t for t, i in zip(("image", "video", "vision_start", "vision_end"), ids)
                   if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(f"the tokenizer has no single token for {unknown}; add Qwen's vision tokens as special tokens")
        self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id = ids

    def check_argument_for_proper_class(self, argument_name, argument):
        # transformers resolves the video base class through a registry that is a stub without
        # torchvision; check against the base classes directly instead.
        from transformers.image_processing_base import ImageProcessingMixin
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.video_processing_utils import VideoProcessorMixin

        expected = {"image_processor": ImageProcessingMixin, "video_processor": VideoProcessorMixin,
                    "tokenizer": PreTrainedTokenizerBase}[argument_name]
        if not isinstance(argument, expected):
            raise TypeError(f"{argument_name} must be a {expected.__name__}, got {type(argument).__name__}")
        return expected

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw"]

    # ------------------------------------------------------------------------------------ call
    def __call__(self, images=None, text=None, videos=None, audio=None, return_tensors=None, **kwargs) -> BatchFeature:
        if text is None:
            raise ValueError("text is required: the prompt(s) with <|image_pad|> / <|video_pad|> placeholders")
        texts = [text] if isinstance(text, str) else list(text)
        text_kwargs, image_kwargs, video_kwargs = self._route_kwargs(kwargs)

        image_counts = [t.count(self.image_token) for t in texts]
        video_counts = [t.count(self.video_token) for t in texts]
        flat_images = self._assign(images, image_counts, "image")
        flat_videos = self._assign(videos, video_counts, "video")

        data: dict[str, Any] = {}
        image_grids, video_grids, video_metas = [], [], []
        if flat_images:
            out = self.image_processor(flat_images, **image_kwargs)
            data.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
            image_grids = out["image_grid_thw"].tolist()
        if flat_videos:
            out = self.video_processor(flat_videos, **video_kwargs)
            data.update(pixel_values_videos=out["pixel_values_videos"], video_grid_thw=out["video_grid_thw"])
            video_grids, video_metas = out["video_grid_thw"].tolist(), out["video_metadata"]

        expanded, replacements, expected = self._expand(texts, image_grids, video_grids, video_metas)
        padding_side = text_kwargs.pop("padding_side", "left")
        text_kwargs.setdefault("padding", True)
        encoded = self.tokenizer(expanded, padding_side=padding_side, return_token_type_ids=False, **text_kwargs)
        ids = encoded["input_ids"]
        max_length = text_kwargs.get("max_length")
        if text_kwargs.get("truncation") not in (None, False, "do_not_truncate") and max_length is not None:
            # what truncation removed is only visible in the untruncated ids
            untruncated = self.tokenizer(expanded, add_special_tokens=text_kwargs.get("add_special_tokens", True))
            self._check_tokens(untruncated["input_ids"], expected, max_length)
        else:
            self._check_tokens(ids, expected, None)
        data["input_ids"] = ids
        data["attention_mask"] = encoded["attention_mask"]
        data["mm_token_type_ids"] = [
            [1 if t == self.image_token_id else 2 if t == self.video_token_id else 0 for t in row] for row in ids
        ]
        if text_kwargs.get("return_offsets_mapping"):
            data["offset_mapping"] = encoded["offset_mapping"]
            data["text_replacement_offsets"] = replacements
        if video_kwargs.get("return_metadata"):
            data["video_metadata"] = video_metas
        return BatchFeature(data, tensor_type=return_tensors, skip_tensor_conversion=["video_metadata", "text_replacement_offsets"])

    def _route_kwargs(self, kwargs: dict) -> tuple[dict, dict, dict]:
        text_kwargs = dict(kwargs.pop("text_kwargs", None) or {})
        image_kwargs = dict(kwargs.pop("images_kwargs", None) or {})
        video_kwargs = dict(kwargs.pop("videos_kwargs", None) or {})
        kwargs.pop("common_kwargs", None)
        image_names = set(VLMKitImageProcessor.defaults) | {"min_pixels", "max_pixels"}
        for key, value in kwargs.items():
            if key in TEXT_KWARGS:
                text_kwargs[key] = value
            elif key in VIDEO_ONLY_KWARGS:
                video_kwargs[key] = value
            elif key in image_names:  # shared settings (size, resample, ...) apply to images only
                image_kwargs[key] = value
            elif key not in IGNORED_KWARGS:
                logger.warning(f"{key!r} is not an argument of VLMKitProcessor and is ignored")
        return text_kwargs, image_kwargs, video_kwargs

    @staticmethod
    def _assign(media, counts: list[int], name: str) -> list:
        """Check media against each sample's placeholders; return them flat, in placeholder order.

        `media` is one item, a flat list of items (spread over the samples in order), or one list per
        sample (what apply_chat_template passes).
        """
        is_item = _is_video if name == "video" else _is_image
        if media is None:
            per_sample = [[] for _ in counts]
        elif is_item(media):
            per_sample = None
            flat = [media]
        elif isinstance(media, (list, tuple)) and all(is_item(m) for m in media):
            per_sample = None
            flat = list(media)
        elif isinstance(media, (list, tuple)) and all(
            isinstance(m, (list, tuple)) and all(is_item(x) for x in m) for m in media
        ):
            per_sample = [list(m) for m in media]
            if len(per_sample) != len(counts):
                raise ValueError(f"{len(per_sample)} per-sample {name} lists were given for {len(counts)} texts")
        else:
            raise TypeError(f"cannot read the {name}s argument: expected one {name}, a list of them, or one list per sample")
        if per_sample is None:
            if len(flat) != sum(counts):
                raise ValueError(
                    f"the text holds {sum(counts)} {name} placeholder(s) (per sample: {counts}) but {len(flat)} "
                    f"{name}(s) were given"
                )
            return flat
        for index, (given, count) in enumerate(zip(per_sample, counts)):
            if len(given) != count:
                raise ValueError(
                    f"sample {index}: its text holds {count} {name} placeholder(s) but {len(given)} {name}(s) were given"
                )
        return [m for sample in per_sample for m in sample]

    def _video_block(self, grid: list[int], meta) -> str:
        fps = meta.fps if meta.fps else DEFAULT_SOURCE_FPS
        stamps = frame_timestamps(meta.frames_indices, fps, self.video_processor.temporal_patch_size)
        per_slice = tokens_per_temporal_slice(grid, self.geometry)
        block = self.vision_start_token + self.video_token * per_slice + self.vision_end_token
        return "".join(f"<{stamps[t]:.1f} seconds>" + block for t in range(grid[0]))

    def _expand(self, texts, image_grids, video_grids, video_metas):
        """Replace placeholders in order. Returns the texts, each replacement's character spans, and
        per sample the (image, video) token counts the expansion wrote."""
        images, videos = iter(image_grids), iter(zip(video_grids, video_metas))
        pattern = re.compile(f"{re.escape(self.image_token)}|{re.escape(self.video_token)}")
        expanded, replacements, counts = [], [], []
        for text in texts:
            pieces, spans, cursor, shift = [], [], 0, 0
            n_image = n_video = 0
            for match in pattern.finditer(text):
                if match.group() == self.image_token:
                    tokens = num_visual_tokens(next(images), self.geometry)
                    new = self.image_token * tokens
                    n_image += tokens
                else:
                    grid, meta = next(videos)
                    new = self._video_block(grid, meta)
                    n_video += num_visual_tokens(grid, self.geometry)
                pieces += [text[cursor:match.start()], new]
                start = match.start() + shift
                spans.append({"span": (match.start(), match.end()), "new_span": (start, start + len(new))})
                shift += len(new) - (match.end() - match.start())
                cursor = match.end()
            pieces.append(text[cursor:])
            expanded.append("".join(pieces))
            replacements.append(spans)
            counts.append((n_image, n_video))
        return expanded, replacements, counts

    def _check_tokens(self, token_ids: list[list[int]], expected: list[tuple[int, int]], max_length: int | None) -> None:
        """Placeholders must tokenize one-to-one, and truncation to `max_length` (None: no truncation;
        then `token_ids` may be padded) must not cut a vision span."""
        vision_ids = {self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id}
        for index, (ids, (n_img, n_vid)) in enumerate(zip(token_ids, expected)):
            got = (ids.count(self.image_token_id), ids.count(self.video_token_id))
            if got != (n_img, n_vid):
                raise ValueError(
                    f"sample {index}: expected {n_img} image and {n_vid} video tokens after expansion but the "
                    f"tokenizer produced {got[0]} and {got[1]}; the vision tokens must be single special tokens"
                )
            if max_length is not None and len(ids) > max_length:
                keep_left = self.tokenizer.truncation_side == "left"
                dropped = ids[:len(ids) - max_length] if keep_left else ids[max_length:]
                if any(t in vision_ids for t in dropped):
                    raise ValueError(
                        f"sample {index} is {len(ids)} tokens long; truncating it to max_length={max_length} would "
                        f"cut a vision span (it holds {n_img} image and {n_vid} video tokens). Raise max_length, "
                        "shrink the images (max_pixels) or drop the sample."
                    )

    # ----------------------------------------------------------------------------- decoding
    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens,
                                           clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    # ------------------------------------------------------------------------------ loading
    @classmethod
    def for_model(cls, config, tokenizer, image_processor=None, video_processor=None, **kwargs) -> "VLMKitProcessor":
        """A processor whose placeholder counts follow `config`'s connector (and its special tokens)."""
        return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                   geometry=geometry_settings(config), **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Loads the processor; when the folder also holds a model config.json, checks that the
        processor's token geometry is the one that model's connector emits."""
        processor = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        config_file = os.path.join(os.fspath(pretrained_model_name_or_path), "config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as handle:
                model_type = json.load(handle).get("model_type")
            if model_type in ("vlmkit", "qwen3_vl"):
                from ..configuration import VLMKitConfig

                expected = geometry_settings(VLMKitConfig.from_pretrained(pretrained_model_name_or_path))
                if geometry_settings(processor.geometry) != expected:
                    raise ValueError(
                        f"the processor in {pretrained_model_name_or_path} counts visual tokens as {processor.geometry} "
                        f"but the model there emits {expected}; save the processor built with "
                        "VLMKitProcessor.for_model(model.config, tokenizer)"
                    )
        return processor

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        """Sub-processors are read with vlmkit's own classes, whatever class name the files give, so
        official Qwen3-VL folders (preprocessor_config.json naming Qwen2VLImageProcessorFast) load
        without torchvision."""
        from transformers import AutoTokenizer

        kwargs.pop("subfolder", None)
        processor_dict = processor_dict or {}
        if isinstance(processor_dict.get("image_processor"), dict):
            image_processor = VLMKitImageProcessor(**processor_dict["image_processor"])
        else:
            image_processor = VLMKitImageProcessor.from_pretrained(pretrained_model_name_or_path, **kwargs)
        if isinstance(processor_dict.get("video_processor"), dict):
            video_processor = VLMKitVideoProcessor(**processor_dict["video_processor"])
        else:
            try:
                video_processor = VLMKitVideoProcessor.from_pretrained(pretrained_model_name_or_path, **kwargs)
            except (OSError, ValueError):
                video_processor = None  # no video config: derived from the image processor in __init__
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, tokenizer, video_processor]


def _is_image(item) -> bool:
    from PIL import Image

    if isinstance(item, (Image.Image, str, bytes, bytearray)) or hasattr(item, "__fspath__"):
        return True
    return getattr(item, "ndim", None) in (2, 3)  # numpy array or torch tensor


def _is_video(item) -> bool:
    """A file path, a (T, H, W, C) array or tensor, or a non-empty list of frames."""
    if isinstance(item, str) or hasattr(item, "__fspath__"):
        return True
    if getattr(item, "ndim", None) == 4:
        return True
    return isinstance(item, (list, tuple)) and len(item) > 0 and all(
        _is_image(f) and not isinstance(f, (str, bytes)) for f in item
    )

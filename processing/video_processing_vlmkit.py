"""Video processor: frames (a list of images, a (T, H, W, C) array or tensor, or a video file) ->
Qwen3-VL video patches, without torchvision.

What it reproduces from Qwen3-VL (transformers 5.24): frame sampling by `fps` (default 2) or
`num_frames`, clamped to [min_frames, max_frames] and to the frames available, at indices
`linspace(0, total - 1, n).round()`; padding to a multiple of temporal_patch_size by repeating the
last frame; one smart resize for the whole clip against a TOTAL pixel budget
`size["longest_edge"]` over all frames; the same normalisation and block-major patch order as
images. Where it differs on purpose: the budget counts the padded frame count (so it always
holds), a 1-frame clip is padded instead of rejected, and frames given as a list or array are used
as they are unless `fps` or `num_frames` is passed (decoded files are always sampled).
Timestamps stay floats in `VideoMetadata` (fps, frames_indices); the processor turns them into
`<t seconds>` text.
"""

import math
import os
from typing import Any

import numpy as np
from PIL import Image
from transformers.image_processing_utils import BatchFeature
from transformers.processing_utils import VideosKwargs
from transformers.utils import logging
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata

from .image_processing_vlmkit import (
    HALF, load_image, map_images, normaliser, patchify, pop_settings, to_rgb, with_pixel_budget,
)

logger = logging.get_logger(__name__)

QWEN3_VL_VIDEO_SIZE = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
DEFAULT_SOURCE_FPS = 24.0  # Qwen3-VL's assumption when a clip carries no fps


class VLMKitVideosKwargs(VideosKwargs, total=False):
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int


def smart_resize_video(num_frames: int, height: int, width: int, factor: int, temporal: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video resize: one (h, w) for the whole clip so that frames * h * w stays within
    [min_pixels, max_pixels]; sides multiples of `factor`; tiny frames upscaled first."""
    if min(height, width) <= 0:
        raise ValueError(f"video frames have zero size ({height}x{width})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"video frames of {height}x{width} have an aspect ratio above 200")
    t_bar = math.ceil(num_frames / temporal) * temporal  # the frame count after padding
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((t_bar * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (t_bar * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_video_file(path: str) -> tuple[list[Image.Image], VideoMetadata]:
    """All frames of a video file with PyAV (the optional `vlmkit[video]` extra)."""
    try:
        import av
    except ImportError as err:
        raise ImportError("reading video files needs PyAV: pip install 'vlmkit[video]'") from err
    if not os.path.isfile(path):
        raise ValueError(f"video file {path!r} does not exist")
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else None
            frames = [frame.to_image() for frame in container.decode(stream)]
    except av.error.FFmpegError as err:  # type: ignore[attr-defined]
        raise ValueError(f"cannot decode video file {path!r}: {err}") from err
    if not frames:
        raise ValueError(f"video file {path!r} has zero frames")
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames[0].width, height=frames[0].height,
                         video_backend="pyav", frames_indices=list(range(len(frames))))
    return frames, meta


def video_frames(video: Any) -> tuple[list, VideoMetadata | None, bool]:
    """(frames, metadata or None, decoded_from_file) for one video input."""
    if isinstance(video, (str, os.PathLike)):
        frames, meta = decode_video_file(os.fspath(video))
        return frames, meta, True
    if hasattr(video, "detach") and hasattr(video, "cpu"):
        video = video.detach().cpu().numpy()
    if isinstance(video, np.ndarray):
        if video.ndim != 4:
            raise ValueError(f"a video array must be (T, H, W, C) or (T, C, H, W), got shape {video.shape}")
        frames = list(video)
    elif isinstance(video, (list, tuple)):
        frames = list(video)
    else:
        raise TypeError(f"unsupported video type {type(video).__name__}; pass frames, an array or a file path")
    if not frames:
        raise ValueError("video has zero frames")
    return frames, None, False


def as_metadata(meta: Any, total: int) -> VideoMetadata | None:
    if meta is None:
        return None
    if isinstance(meta, VideoMetadata):
        return meta
    if isinstance(meta, dict):
        meta = dict(meta)
        meta.setdefault("total_num_frames", total)
        return VideoMetadata(**{k: v for k, v in meta.items() if k in VideoMetadata.__dataclass_fields__})
    raise TypeError(f"video_metadata must be a dict or VideoMetadata, got {type(meta).__name__}")


class VLMKitVideoProcessor(VideoProcessorMixin):
    r"""Qwen3-VL video preprocessing in PIL + numpy. Returns `pixel_values_videos`
    (patches, C*T*P*P), `video_grid_thw` (videos, 3) and, with `return_metadata`, `video_metadata`."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    valid_kwargs = VLMKitVideosKwargs
    defaults = dict(
        do_resize=True, size=QWEN3_VL_VIDEO_SIZE, resample=Image.Resampling.BICUBIC, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=HALF, image_std=HALF, do_convert_rgb=True,
        patch_size=16, temporal_patch_size=2, merge_size=2, fps=2.0, num_frames=None, min_frames=4,
        max_frames=768, do_sample_frames=None, return_metadata=True,
    )

    def __init__(self, **kwargs):
        kwargs.pop("video_processor_type", None)
        settings = pop_settings(self.defaults, kwargs)
        # VideoProcessorMixin.__init__ validates torchvision-era kwargs; set plain attributes instead.
        for key, value in {**kwargs, **settings}.items():
            setattr(self, key, value)

    def to_dict(self) -> dict:
        out = {key: getattr(self, key) for key in self.defaults}
        out["video_processor_type"] = type(self).__name__
        return out

    def _settings(self, overrides: dict) -> dict:
        unknown = set(overrides) - set(self.defaults) - {"min_pixels", "max_pixels", "video_metadata"}
        if unknown:
            raise TypeError(f"unknown video processor argument(s): {sorted(unknown)}")
        settings = {key: overrides[key] if overrides.get(key) is not None else getattr(self, key) for key in self.defaults}
        if overrides.get("num_frames") is not None or overrides.get("fps") is not None:
            settings["num_frames"], settings["fps"] = overrides.get("num_frames"), overrides.get("fps")
        elif settings["num_frames"] is not None:  # a configured frame count takes precedence over fps
            settings["fps"] = None
        settings["size"] = with_pixel_budget(settings["size"], overrides.get("min_pixels"), overrides.get("max_pixels"))
        return settings

    def sample_indices(self, meta: VideoMetadata, settings: dict) -> np.ndarray:
        """Qwen3-VL sampling: n frames evenly over the clip, n from fps or num_frames, clamped."""
        total = meta.total_num_frames
        num_frames, fps = settings["num_frames"], settings["fps"]
        if num_frames is not None and fps is not None:
            raise ValueError("num_frames and fps are mutually exclusive; pass only one")
        if num_frames is None and fps is not None:
            source_fps = meta.fps if meta.fps else DEFAULT_SOURCE_FPS
            num_frames = int(total / source_fps * fps)
        num_frames = total if num_frames is None else num_frames
        num_frames = min(max(num_frames, settings["min_frames"]), settings["max_frames"], total)
        return np.linspace(0, total - 1, num_frames).round().astype(int)

    def __call__(self, videos, return_tensors=None, **kwargs) -> BatchFeature:
        return self.preprocess(videos, return_tensors=return_tensors, **kwargs)

    def preprocess(self, videos, return_tensors=None, video_metadata=None, **kwargs) -> BatchFeature:
        videos = _as_video_list(videos)
        if not videos:
            raise ValueError("no videos were given")
        metas = video_metadata if isinstance(video_metadata, (list, tuple)) else [video_metadata] * len(videos)
        if len(metas) != len(videos):
            raise ValueError(f"{len(metas)} video_metadata entries for {len(videos)} videos")
        explicit_sampling = kwargs.get("fps") is not None or kwargs.get("num_frames") is not None
        settings = self._settings(kwargs)
        normalise = normaliser(settings["rescale_factor"], settings["image_mean"], settings["image_std"],
                               settings["do_rescale"], settings["do_normalize"])
        patches, grids, out_metas = [], [], []
        for index, (video, given_meta) in enumerate(zip(videos, metas)):
            frames, file_meta, from_file = video_frames(video)
            meta = as_metadata(given_meta, len(frames)) or file_meta
            if meta is None:
                meta = VideoMetadata(total_num_frames=len(frames), fps=None, frames_indices=list(range(len(frames))))
            if meta.fps is None:
                logger.warning(
                    f"video {index} has no fps in its metadata; its timestamps assume {DEFAULT_SOURCE_FPS} fps. "
                    "Pass video_metadata={'fps': ...} for correct times."
                )
            sample = settings["do_sample_frames"]
            sample = (from_file or explicit_sampling) if sample is None else sample
            if sample:
                picked = self.sample_indices(VideoMetadata(total_num_frames=len(frames), fps=meta.fps), settings)
                frames = [frames[i] for i in picked]
                source_indices = meta.frames_indices or list(range(meta.total_num_frames))
                meta = VideoMetadata(total_num_frames=meta.total_num_frames, fps=meta.fps, width=meta.width,
                                     height=meta.height, duration=meta.duration, video_backend=meta.video_backend,
                                     frames_indices=[int(source_indices[i]) for i in picked])
            elif meta.frames_indices is None:
                meta.frames_indices = list(range(len(frames)))
            if len(meta.frames_indices) != len(frames):
                raise ValueError(
                    f"video {index}: metadata lists {len(meta.frames_indices)} frame indices for {len(frames)} frames"
                )
            pixels, grid = self._encode(frames, settings, normalise, index)
            patches.append(pixels)
            grids.append(grid)
            out_metas.append(meta)
        data = {"pixel_values_videos": np.concatenate(patches), "video_grid_thw": np.asarray(grids, dtype=np.int64)}
        result = BatchFeature(data=data, tensor_type=return_tensors)
        if settings["return_metadata"]:
            result["video_metadata"] = out_metas
        return result

    def _encode(self, frames: list, settings: dict, normalise, index: int) -> tuple[np.ndarray, list[int]]:
        tp, p, m = settings["temporal_patch_size"], settings["patch_size"], settings["merge_size"]
        first = to_rgb(load_image(frames[0]))
        if settings["do_resize"]:
            h, w = smart_resize_video(len(frames), first.height, first.width, p * m, tp,
                                      settings["size"]["shortest_edge"], settings["size"]["longest_edge"])
        else:
            h, w = first.height, first.width

        def prepare(frame):
            image = to_rgb(load_image(frame)) if settings["do_convert_rgb"] else load_image(frame)
            if image.size != first.size:
                raise ValueError(f"video {index}: frames differ in size ({image.size} vs {first.size})")
            return image.resize((w, h), resample=settings["resample"]) if settings["do_resize"] else image

        pixels = np.stack([np.asarray(f, dtype=np.uint8) for f in map_images(prepare, frames)])  # (T, H, W, 3)
        if h % (p * m) or w % (p * m):
            raise ValueError(f"video {index}: frame size {h}x{w} must be a multiple of {p * m} with do_resize=False")
        pad = -len(pixels) % tp  # repeat the last frame up to a multiple of the temporal patch
        if pad:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        return patchify(pixels, p, m, tp, normalise), [len(pixels) // tp, h // p, w // p]


def _as_video_list(videos) -> list:
    """One video or a list of videos (a video being a file path, an array, or a list of frames)."""
    if videos is None:
        return []
    if isinstance(videos, (str, os.PathLike)) or (hasattr(videos, "ndim") and videos.ndim == 4):
        return [videos]
    if isinstance(videos, (list, tuple)):
        if not videos:
            return []
        first = videos[0]
        if isinstance(first, Image.Image) or (hasattr(first, "ndim") and first.ndim == 3):
            return [videos]  # a single video given as a list of frames
        flat = []
        for item in videos:  # per-sample nesting from apply_chat_template: [[v1], [v2, v3]]
            if isinstance(item, (list, tuple)) and item and not (
                isinstance(item[0], Image.Image) or (hasattr(item[0], "ndim") and item[0].ndim == 3)
            ):
                flat.extend(item)
            else:
                flat.append(item)
        return flat
    return [videos]

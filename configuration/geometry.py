"""Token-grid geometry shared by the processor and the model (torch-free on purpose).

An image or video enters the vision tower as a grid of patches `(t, h, w)` (`grid_thw`, in patch
units). The connector turns it into `t * gh * gw` language-model tokens laid out on an LLM grid
`(t, gh, gw)`. The processor inserts exactly that many placeholders; the model checks the count at
run time. Both import the functions below, so they cannot disagree.
"""

from collections.abc import Mapping, Sequence
from typing import Any

CONNECTOR_TYPES = ("merger",)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def llm_grid_thw(grid_thw: Sequence[int], config: Any) -> tuple[int, int, int]:
    """LLM token grid `(t, gh, gw)` for one image/video patch grid `(t, h, w)`.

    `config` is a `VLMKitConfig`, or any mapping/object with `connector_type` and
    `spatial_merge_size` (the processor passes its own settings).
    """
    t, h, w = (int(x) for x in grid_thw)
    connector_type = _get(config, "connector_type", "merger")
    vision_config = _get(config, "vision_config", None)
    merge = _get(config, "spatial_merge_size", None) or _get(vision_config, "spatial_merge_size", 2)
    if connector_type == "merger":
        if h % merge or w % merge:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) is not divisible by spatial_merge_size {merge}")
        return t, h // merge, w // merge
    raise ValueError(f"connector_type {connector_type!r} is not one of {list(CONNECTOR_TYPES)}")


def num_visual_tokens(grid_thw: Sequence[int], config: Any) -> int:
    """Number of placeholder tokens one image or video with patch grid `grid_thw` becomes."""
    t, gh, gw = llm_grid_thw(grid_thw, config)
    return t * gh * gw


def tokens_per_temporal_slice(grid_thw: Sequence[int], config: Any) -> int:
    """Placeholder tokens per temporal slice: Qwen3-VL writes each video slice as its own block."""
    _, gh, gw = llm_grid_thw(grid_thw, config)
    return gh * gw

"""Token-grid geometry shared by the processor and the model (torch-free on purpose).

An image or video enters the vision tower as a grid of patches `(t, h, w)` (`grid_thw`, in patch
units). The connector turns it into `t * gh * gw` language-model tokens laid out on an LLM grid
`(t, gh, gw)`. The processor inserts exactly that many placeholders; the model checks the count at
run time. Both import the functions below, so they cannot disagree.

| connector | LLM grid of (t, h, w)        | M-RoPE layout                 |
|-----------|------------------------------|-------------------------------|
| merger    | (t, h/m, w/m)                | "grid"                        |
| mlp       | (t, h, w), one token a patch | "grid"                        |
| qformer   | (t, gh, gw), gh*gw = Q       | "sequence" (or "grid")        |
| resampler | (t, gh, gw), gh*gw = Q       | "sequence" (or "grid")        |

Every video temporal slice is its own placeholder block, so query connectors emit Q tokens per
slice. `config` below is a `VLMKitConfig` or the flat mapping `geometry_settings` returns (what the
processor stores in its own config).
"""

from collections.abc import Mapping, Sequence
from typing import Any

CONNECTOR_TYPES = ("merger", "mlp", "qformer", "resampler")
MROPE_LAYOUTS = ("grid", "sequence")

# Connectors that emit a fixed number of learned queries per item, and the setting holding it.
QUERY_COUNT_FIELDS = {"qformer": "num_queries", "resampler": "num_latents"}
# BLIP-2 num_query_tokens and Idefics2 resampler_n_latents; the connector config takes its defaults here.
DEFAULT_NUM_QUERIES = 32
DEFAULT_NUM_LATENTS = 64
_DEFAULT_QUERY_COUNTS = {"num_queries": DEFAULT_NUM_QUERIES, "num_latents": DEFAULT_NUM_LATENTS}
# Spatial connectors keep the real patch grid; query connectors default to 1-D text-like positions.
_NATURAL_LAYOUTS = {"merger": "grid", "mlp": "grid", "qformer": "sequence", "resampler": "sequence"}


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def default_query_grid(num_queries: int) -> tuple[int, int]:
    """The most square (gh, gw) with gh * gw = num_queries and gh <= gw: 32 -> (4, 8), 64 -> (8, 8)."""
    gh = max(d for d in range(1, int(num_queries**0.5) + 1) if num_queries % d == 0)
    return gh, num_queries // gh


def geometry_settings(config: Any) -> dict:
    """The flat, JSON-serialisable settings every function here reads, from a `VLMKitConfig`.

    A mapping is taken as already flat (the processor's stored copy) and completed with defaults.
    Keys: connector_type, spatial_merge_size, mrope_layout, and for query connectors the query count
    (num_queries or num_latents) and query_grid [gh, gw].
    """
    connector_type = _get(config, "connector_type", "merger")
    if connector_type not in CONNECTOR_TYPES:
        raise ValueError(f"connector_type {connector_type!r} is not one of {list(CONNECTOR_TYPES)}")
    flat = isinstance(config, Mapping)
    source = config if flat else _get(config, "connector_config")
    vision_config = None if flat else _get(config, "vision_config")
    merge = _get(config, "spatial_merge_size") or _get(vision_config, "spatial_merge_size", 2)
    settings = {"connector_type": connector_type, "spatial_merge_size": int(merge)}

    layout = _get(source, "mrope_layout") or _NATURAL_LAYOUTS[connector_type]
    if layout not in MROPE_LAYOUTS:
        raise ValueError(f"mrope_layout {layout!r} is not one of {list(MROPE_LAYOUTS)}")
    if _NATURAL_LAYOUTS[connector_type] == "grid" and layout != "grid":
        raise ValueError(f"mrope_layout {layout!r} is not available for connector_type {connector_type!r}: "
                         "its tokens lie on the real patch grid, so the layout is always 'grid'")
    settings["mrope_layout"] = layout

    count_field = QUERY_COUNT_FIELDS.get(connector_type)
    if count_field is not None:
        count = _get(source, count_field)
        count = _DEFAULT_QUERY_COUNTS[count_field] if count is None else int(count)
        if count < 1:
            raise ValueError(f"{count_field} must be at least 1, got {count}")
        grid = _get(source, "query_grid")
        gh, gw = (int(x) for x in grid) if grid else default_query_grid(count)
        if gh * gw != count:
            raise ValueError(f"query_grid ({gh}, {gw}) has {gh * gw} cells but {count_field} is {count}")
        settings[count_field] = count
        settings["query_grid"] = [gh, gw]
    return settings


def mrope_layout(config: Any) -> str:
    """"grid" (t, row, col positions over the LLM grid) or "sequence" (t = h = w, one step a token)."""
    return geometry_settings(config)["mrope_layout"]


def llm_grid_thw(grid_thw: Sequence[int], config: Any) -> tuple[int, int, int]:
    """LLM token grid `(t, gh, gw)` for one image/video patch grid `(t, h, w)`."""
    t, h, w = (int(x) for x in grid_thw)
    settings = geometry_settings(config)
    merge = settings["spatial_merge_size"]
    # Every connector reads patches in the processor's merge-block order, so the grid must tile.
    if h % merge or w % merge:
        raise ValueError(f"grid (t={t}, h={h}, w={w}) is not divisible by spatial_merge_size {merge}")
    connector_type = settings["connector_type"]
    if connector_type == "merger":
        return t, h // merge, w // merge
    if connector_type == "mlp":
        return t, h, w
    gh, gw = settings["query_grid"]
    return t, gh, gw


def num_visual_tokens(grid_thw: Sequence[int], config: Any) -> int:
    """Number of placeholder tokens one image or video with patch grid `grid_thw` becomes."""
    t, gh, gw = llm_grid_thw(grid_thw, config)
    return t * gh * gw


def tokens_per_temporal_slice(grid_thw: Sequence[int], config: Any) -> int:
    """Placeholder tokens per temporal slice: Qwen3-VL writes each video slice as its own block."""
    _, gh, gw = llm_grid_thw(grid_thw, config)
    return gh * gw

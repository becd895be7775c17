"""Vision-to-language connectors: one interface, a registry keyed by `connector_type`, one file each.

| connector_type | file         | reference                                   | tokens per (t, h, w) |
|----------------|--------------|---------------------------------------------|----------------------|
| merger         | merger.py    | Qwen3-VL `Qwen3VLVisionPatchMerger`         | t * h/m * w/m        |
| mlp            | mlp.py       | LLaVA-1.5 `mlp2x_gelu`                      | t * h * w            |
| qformer        | qformer.py   | BLIP-2 Q-Former                             | t * num_queries      |
| resampler      | resampler.py | Idefics2 perceiver resampler                | t * num_latents      |
"""

from . import merger, mlp, qformer, resampler  # noqa: F401  (each registers itself)
from .base import CONNECTORS, QUERY_INIT_STD, VisionConnector, build_connector, register_connector

__all__ = ["CONNECTORS", "QUERY_INIT_STD", "VisionConnector", "build_connector", "register_connector"]

"""Model builder shared by the connector tests."""

import torch
from helpers import EOS, PAD, perturb_, tiny_connector_config_dict

import vlmkit

QUERY_CONNECTORS = ("qformer", "resampler")
CONNECTOR_PREFIXES = ("model.visual.merger.", "model.visual.deepstack_merger_list.")


def build_model(connector_type: str, seed: int = 0, **connector_overrides) -> vlmkit.VLMKitForConditionalGeneration:
    """A tiny random model with the given connector, every weight perturbed off its trivial init."""
    config = vlmkit.VLMKitConfig(**tiny_connector_config_dict(connector_type, **connector_overrides))
    torch.manual_seed(seed)
    model = perturb_(vlmkit.VLMKitForConditionalGeneration(config), seed)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model.eval()

"""LoRA targets by scope: never the other tower, never a Conv3d, an Embedding or a norm (item 12)."""

import pytest
import torch
from helpers import tiny_connector_config_dict
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

import vlmkit
from vlmkit.configuration import CONNECTOR_TYPES
from vlmkit.training import LORA_SCOPES, connector_module_names, lora_target_modules

VISION = "model.visual."
CONNECTOR = ("model.visual.merger.", "model.visual.deepstack_merger_list.")
LLM = "model.language_model."
# Linear layers per component of the tiny configuration (4 text layers, 4 vision blocks, 3 DeepStack levels)
LLM_LINEARS = 4 * 7
VISION_LINEARS = 4 * 4
# per connector instance (main + 3 DeepStack): merger fc1, fc2; mlp 2 layers; Q-Former layer 0 with self- and
# cross-attention (4 + 4) and its MLP (2), layer 1 without cross-attention (4 + 2), the projection (1);
# resampler SwiGLU projection (3) and 2 layers of attention (4) and SwiGLU (3)
CONNECTOR_LINEARS = {
    "merger": 4 * 2, "mlp": 4 * 2, "qformer": 4 * (4 + 4 + 2 + 4 + 2 + 1), "resampler": 4 * (3 + 2 * (4 + 3)),
}


def _model(connector_type: str) -> vlmkit.VLMKitForConditionalGeneration:
    torch.manual_seed(0)
    return vlmkit.VLMKitForConditionalGeneration(vlmkit.VLMKitConfig(**tiny_connector_config_dict(connector_type)))


def _adapted(model, scope: str) -> dict[str, nn.Module]:
    """{module name: the layer LoRA wraps} after get_peft_model with this scope's targets."""
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=lora_target_modules(model, scope)))
    prefix = "base_model.model."
    return {name[len(prefix):]: module.base_layer for name, module in peft_model.named_modules()
            if isinstance(module, LoraLayer)}


@pytest.mark.parametrize("connector_type", CONNECTOR_TYPES)
def test_each_scope_adapts_only_its_components(connector_type):
    counts = {}
    for scope in LORA_SCOPES:
        adapted = _adapted(_model(connector_type), scope)
        counts[scope] = {
            "llm": sum(n.startswith(LLM) for n in adapted),
            "connector": sum(n.startswith(CONNECTOR) for n in adapted),
            "vision": sum(n.startswith(VISION) and not n.startswith(CONNECTOR) for n in adapted),
        }
        assert sum(counts[scope].values()) == len(adapted)  # nothing else (no lm_head)
        assert all(type(layer) is nn.Linear for layer in adapted.values()), scope
    connector = CONNECTOR_LINEARS[connector_type]
    assert counts == {
        "llm": {"llm": LLM_LINEARS, "connector": 0, "vision": 0},
        "vision": {"llm": 0, "connector": 0, "vision": VISION_LINEARS},
        "connector": {"llm": 0, "connector": connector, "vision": 0},
        "all": {"llm": LLM_LINEARS, "connector": connector, "vision": VISION_LINEARS},
    }


def test_suffixes_shared_by_both_towers_stay_in_their_tower():
    """The resampler's SwiGLU and attention reuse the LLM's names; a plain suffix list adapts both."""
    model = _model("resampler")
    plain = get_peft_model(_model("resampler"), LoraConfig(r=2, target_modules=["gate_proj", "q_proj"]))
    plain_names = [n for n, m in plain.named_modules() if isinstance(m, LoraLayer)]
    # the hazard the scopes avoid: 3 gate_proj and 2 q_proj in each of the 4 resampler instances
    assert sum(".visual." in n for n in plain_names) == 4 * (3 + 2)
    llm = _adapted(model, "llm")
    assert {n.rsplit(".", 1)[-1] for n in llm} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    assert not any(n.startswith(VISION) for n in llm)


def test_no_scope_wraps_a_conv_an_embedding_or_a_norm():
    model = _model("qformer")
    never = (nn.Conv3d, nn.Embedding, nn.LayerNorm, vlmkit.modeling.text.VLMKitRMSNorm)
    excluded = {n for n, m in model.named_modules() if isinstance(m, never)}
    assert {"model.visual.patch_embed.proj", "model.visual.pos_embed", "model.language_model.embed_tokens"} <= excluded
    adapted = _adapted(model, "all")
    assert not excluded & set(adapted) and "lm_head" not in adapted
    assert connector_module_names(model) == ["model.visual.merger"] + [f"model.visual.deepstack_merger_list.{i}"
                                                                      for i in range(3)]
    with pytest.raises(ValueError, match="scope must be one of"):
        lora_target_modules(model, "everything")

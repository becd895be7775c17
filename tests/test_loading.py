"""Loading official-layout checkpoints, saving vlmkit checkpoints, strictness and Auto classes."""

import re

import pytest
import torch
from helpers import batch_inputs, sample
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

import vlmkit
from vlmkit.modeling.rotary import VLMKitTextRotaryEmbedding, VLMKitVisionRotaryEmbedding


def _inputs():
    return batch_inputs([sample(2).text(3).image(4, 6).text(4)])


@pytest.mark.parametrize("tied", [False, True])
def test_reference_checkpoint_loads_with_no_missing_or_unexpected_keys(tied, request, load_ours):
    path, ref = request.getfixturevalue("reference_checkpoint_tied" if tied else "reference_checkpoint")
    ours, info = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    ref_state = ref.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    assert (ours.lm_head.weight is ours.get_input_embeddings().weight) == tied
    inputs = _inputs()
    with torch.no_grad():
        assert (ours.eval()(**inputs).logits - ref(**inputs).logits).abs().max().item() <= 1e-5


def test_rotary_buffers_are_valid_after_meta_device_loading(reference_checkpoint, load_ours):
    ours = load_ours(reference_checkpoint[0])
    for module in ours.modules():
        if isinstance(module, VLMKitTextRotaryEmbedding):
            expected, _ = module.compute_default_rope_parameters(module.config)
        elif isinstance(module, VLMKitVisionRotaryEmbedding):
            expected, _ = module.compute_axial_rope_parameters(module.config)
        else:
            continue
        assert torch.equal(module.inv_freq, expected)


def test_vlmkit_save_and_reload_is_bit_identical(reference_checkpoint, load_ours, tmp_path):
    ours = load_ours(reference_checkpoint[0])
    ours.save_pretrained(tmp_path)
    again, info = vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert again.config.model_type == "vlmkit"
    state = again.state_dict()
    assert state.keys() == ours.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    inputs = _inputs()
    with torch.no_grad():
        assert torch.equal(ours(**inputs).logits, again.eval()(**inputs).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_layout_is_column_major_and_saves_contiguous(tied, request, tmp_path):
    """lm_head (untied) and the MLP gate/up weights are stored column-major after loading, the
    values are the checkpoint's, and saving writes ordinary contiguous tensors."""
    path, ref = request.getfixturevalue("reference_checkpoint_tied" if tied else "reference_checkpoint")
    ours = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path)
    mlp = ours.model.language_model.layers[0].mlp
    for weight in (mlp.gate_proj.weight, mlp.up_proj.weight):
        assert weight.stride() == (1, weight.shape[0])
    assert mlp.down_proj.weight.is_contiguous()
    lm_head = ours.lm_head.weight
    # a tied lm_head is the embedding table, which is read row by row: it stays row-major
    assert lm_head.is_contiguous() == tied and (tied or lm_head.stride() == (1, lm_head.shape[0]))
    assert torch.equal(lm_head, ref.lm_head.weight)
    ours.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert all(t.is_contiguous() for t in saved.values())
    assert torch.equal(saved["model.language_model.layers.0.mlp.up_proj.weight"], mlp.up_proj.weight)


def test_auto_classes_resolve_to_vlmkit(reference_checkpoint, load_ours, tmp_path):
    load_ours(reference_checkpoint[0]).save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is vlmkit.VLMKitConfig
    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path)) is vlmkit.VLMKitForConditionalGeneration
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is vlmkit.VLMKitModel
    assert type(base.visual) is vlmkit.VLMKitVisionModel and type(base.language_model) is vlmkit.VLMKitTextModel


@pytest.mark.parametrize("drop", ["model.visual.blocks.1.attn.qkv.weight", "model.language_model.layers.2.mlp.up_proj.weight",
                                  "model.visual.deepstack_merger_list.0.linear_fc2.bias", "lm_head.weight"])
def test_a_missing_weight_fails_loudly(reference_checkpoint, tmp_path, drop):
    path, ref = reference_checkpoint
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[drop]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not contain 1 weight\(s\).*" + re.escape(drop)):
        vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path)
    model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path, allow_missing_weights=True)
    assert isinstance(model, vlmkit.VLMKitForConditionalGeneration)

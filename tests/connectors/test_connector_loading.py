"""A Qwen3-VL-layout checkpoint loaded into every connector configuration (item 5)."""

import logging

import pytest
import torch
from helpers import TINY_CONNECTOR_CONFIG, batch_inputs, sample
from safetensors.torch import load_file, save_file

import vlmkit

from .connector_testing import CONNECTOR_PREFIXES, QUERY_CONNECTORS, build_model

LOADING_LOGGER = "vlmkit.modeling.modeling_vlmkit"


def _load(path, connector_type, **kwargs):
    return vlmkit.VLMKitForConditionalGeneration.from_pretrained(
        path, connector_type=connector_type, connector_config=TINY_CONNECTOR_CONFIG, output_loading_info=True, **kwargs
    )


def test_only_connector_weights_are_new(reference_checkpoint, connector_type, caplog):
    path, ref = reference_checkpoint
    with caplog.at_level(logging.WARNING, logger=LOADING_LOGGER):
        ours, info = _load(path, connector_type)
    assert ours.config.connector_type == connector_type
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    connector_keys = {k for k in ours_state if k.startswith(CONNECTOR_PREFIXES)}
    ref_connector_keys = {k for k in ref_state if k.startswith(CONNECTOR_PREFIXES)}
    assert info["mismatched_keys"] == set()
    warning = [r.getMessage() for r in caplog.records if r.name == LOADING_LOGGER]
    if connector_type == "merger":
        assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
        assert warning == []
    else:
        assert info["missing_keys"] == connector_keys
        assert info["unexpected_keys"] == ref_connector_keys
        assert len(warning) == 1
        assert f"the checkpoint's connector is 'merger', this model's is {connector_type!r}: " \
               f"{len(connector_keys)} connector weight(s) are new" in warning[0]
        assert f"{len(ref_connector_keys)} checkpoint connector weight(s) are not used" in warning[0]
    # the vision tower and the language model are the checkpoint's, bit for bit
    kept = [k for k in ours_state if not k.startswith(CONNECTOR_PREFIXES)]
    assert len(kept) == len(ref_state) - len(ref_connector_keys)
    for name in kept:
        assert torch.equal(ours_state[name], ref_state[name]), name


def test_the_merger_configuration_keeps_the_reference_logits(reference_checkpoint):
    path, ref = reference_checkpoint
    ours, _ = _load(path, "merger")
    inputs = batch_inputs([sample(2).text(3).image(4, 6).text(2).video(2, 4, 4).text(3)])
    with torch.no_grad():
        assert (ours.eval()(**inputs).logits - ref(**inputs).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("connector_type", QUERY_CONNECTORS)
def test_new_queries_are_drawn_distinct_when_loading(reference_checkpoint, connector_type):
    ours, _ = _load(reference_checkpoint[0], connector_type)
    visual = ours.model.visual
    for connector in [visual.merger, *visual.deepstack_merger_list]:
        for name in connector.learned_query_names:
            queries = getattr(connector, name).detach()
            assert 0.015 < queries.std().item() < 0.025
            distances = torch.cdist(queries[None], queries[None])[0] + torch.eye(len(queries)) * 1e9
            assert distances.min().item() > 1e-3


def test_a_missing_tower_weight_still_fails_after_a_connector_change(reference_checkpoint, tmp_path):
    path, ref = reference_checkpoint
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.visual.blocks.1.attn.qkv.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    only_the_block = r"does not contain 1 weight\(s\).*: model\.visual\.blocks\.1\.attn\.qkv\.weight\."
    with pytest.raises(ValueError, match=only_the_block):
        _load(tmp_path, "qformer")


def test_a_missing_connector_weight_fails_when_the_connector_is_unchanged(tmp_path):
    build_model("qformer").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.visual.merger.query_tokens"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not contain 1 weight\(s\).*model\.visual\.merger\.query_tokens"):
        vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path)


def test_passing_a_config_object_works_like_the_keyword_arguments(reference_checkpoint):
    path, _ = reference_checkpoint
    config = vlmkit.VLMKitConfig.from_pretrained(
        path, connector_type="resampler", connector_config=TINY_CONNECTOR_CONFIG
    )
    ours, info = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, config=config, output_loading_info=True)
    assert ours.config.connector_type == "resampler" and ours.config.connector_config.num_latents == 5
    assert info["missing_keys"] and all(k.startswith(CONNECTOR_PREFIXES) for k in info["missing_keys"])

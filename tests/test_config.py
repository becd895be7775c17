import json

import pytest
from helpers import IMAGE, tiny_config_dict
from transformers import Qwen3VLConfig

from vlmkit import VLMKitConfig, VLMKitTextConfig, VLMKitVisionConfig
from vlmkit.configuration import llm_grid_thw, num_visual_tokens


def test_defaults_follow_qwen3_vl():
    ours, ref = VLMKitConfig(), Qwen3VLConfig()
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "tie_word_embeddings"):
        assert getattr(ours, name) == getattr(ref, name)
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
                 "temporal_patch_size", "out_hidden_size", "num_position_embeddings", "hidden_act"):
        assert getattr(ours.vision_config, name) == getattr(ref.vision_config, name), name
    assert list(ours.vision_config.deepstack_visual_indexes) == list(ref.vision_config.deepstack_visual_indexes)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "rope_parameters"):
        assert getattr(ours.text_config, name) == getattr(ref.text_config, name), name
    assert ours.connector_type == "merger"
    assert ours.model_type == "vlmkit"


def test_reads_a_config_saved_by_the_reference(tmp_path):
    Qwen3VLConfig(**tiny_config_dict()).save_pretrained(tmp_path)
    cfg = VLMKitConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "vlmkit"
    assert isinstance(cfg.vision_config, VLMKitVisionConfig) and isinstance(cfg.text_config, VLMKitTextConfig)
    assert cfg.image_token_id == IMAGE
    assert cfg.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert cfg.text_config.rope_parameters["rope_theta"] == 5e6
    assert cfg.vision_config.deepstack_visual_indexes == [0, 1, 2]


def test_reads_the_legacy_rope_scaling_form(tmp_path):
    """Hub files written by transformers 4.57: rope_scaling + rope_theta, vision model_type 'qwen3_vl'."""
    legacy = tiny_config_dict(tie_word_embeddings=True)
    text = legacy["text_config"]
    text.pop("rope_parameters")
    text.update(rope_scaling={"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
                rope_theta=5000000, model_type="qwen3_vl_text")
    legacy["vision_config"]["model_type"] = "qwen3_vl"
    legacy.update(model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"],
                  transformers_version="4.57.0.dev0")
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    cfg = VLMKitConfig.from_pretrained(tmp_path)
    assert cfg.text_config.rope_parameters["rope_theta"] == 5000000
    assert cfg.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert cfg.text_config.mrope_section == [2, 3, 3]
    assert cfg.vision_config.model_type == "vlmkit_vision"
    assert cfg.tie_word_embeddings is True


def test_save_and_reload_keeps_every_field(tmp_path):
    cfg = VLMKitConfig(**tiny_config_dict())
    cfg.save_pretrained(tmp_path)
    again = VLMKitConfig.from_pretrained(tmp_path)
    assert again.to_dict() == cfg.to_dict()


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="connector_type 'lstm'"):
        VLMKitConfig(**tiny_config_dict(connector_type="lstm"))
    bad = tiny_config_dict()
    bad["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 2, 2]}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2, 2\] must sum to head_dim/2 = 8"):
        VLMKitConfig(**bad)


def test_token_geometry_is_torch_free_and_exact():
    cfg = VLMKitConfig(**tiny_config_dict())
    assert llm_grid_thw((1, 4, 6), cfg) == (1, 2, 3)
    assert num_visual_tokens((1, 4, 6), cfg) == 6
    assert num_visual_tokens((3, 8, 4), cfg) == 24
    assert num_visual_tokens((1, 4, 6), {"connector_type": "merger", "spatial_merge_size": 2}) == 6
    with pytest.raises(ValueError, match=r"grid \(t=1, h=5, w=6\) is not divisible by spatial_merge_size 2"):
        num_visual_tokens((1, 5, 6), cfg)

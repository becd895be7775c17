"""Connector configuration, the registry and the torch-free token geometry."""

import json

import pytest
from helpers import TINY_CONNECTOR_CONFIG, tiny_config_dict, tiny_connector_config_dict
from transformers import AutoConfig, Qwen3VLConfig

import vlmkit
from vlmkit.configuration import (
    CONNECTOR_TYPES,
    geometry_settings,
    llm_grid_thw,
    mrope_layout,
    num_visual_tokens,
    tokens_per_temporal_slice,
)
from vlmkit.modeling.connectors import CONNECTORS, build_connector


def test_defaults_equal_the_references():
    """LLaVA-1.5 mlp2x_gelu, BLIP-2 Q-Former (32/12/768/12/freq 2), Idefics2 perceiver (64/3/16/96/4)."""
    c = vlmkit.VLMKitConnectorConfig()
    assert (c.mlp_depth, c.mlp_hidden_act) == (2, "gelu")
    assert (c.num_queries, c.qformer_num_layers, c.qformer_hidden_size, c.qformer_num_heads,
            c.qformer_intermediate_size, c.cross_attention_frequency) == (32, 12, 768, 12, 3072, 2)
    assert (c.num_latents, c.resampler_depth, c.resampler_num_heads, c.resampler_head_dim,
            c.resampler_num_key_value_heads, c.resampler_hidden_act) == (64, 3, 16, 96, 4, "silu")
    assert (c.use_deepstack, c.mrope_layout, c.query_grid) == (True, None, None)
    assert c.model_type == "vlmkit_connector"
    assert type(AutoConfig.for_model("vlmkit_connector")) is vlmkit.VLMKitConnectorConfig


def test_a_qwen3_vl_config_reads_as_the_merger_with_deepstack(tmp_path):
    Qwen3VLConfig(**tiny_config_dict()).save_pretrained(tmp_path)
    assert "connector_config" not in json.loads((tmp_path / "config.json").read_text())
    cfg = vlmkit.VLMKitConfig.from_pretrained(tmp_path)
    assert cfg.connector_type == "merger"
    assert isinstance(cfg.connector_config, vlmkit.VLMKitConnectorConfig)
    assert cfg.connector_config.use_deepstack is True
    assert geometry_settings(cfg) == {"connector_type": "merger", "spatial_merge_size": 2, "mrope_layout": "grid"}


def test_loading_kwargs_pick_another_connector_and_update_its_settings(tmp_path):
    Qwen3VLConfig(**tiny_config_dict()).save_pretrained(tmp_path)
    cfg = vlmkit.VLMKitConfig.from_pretrained(
        tmp_path, connector_type="qformer", connector_config=TINY_CONNECTOR_CONFIG
    )
    assert cfg.connector_type == "qformer"
    assert (cfg.connector_config.num_queries, cfg.connector_config.qformer_num_layers) == (6, 2)
    cfg.save_pretrained(tmp_path / "q")
    again = AutoConfig.from_pretrained(tmp_path / "q", connector_config={"num_queries": 4})
    assert again.connector_config.num_queries == 4 and again.connector_config.qformer_num_layers == 2
    with pytest.raises(ValueError, match="connector_type 'lstm' is not one of"):
        vlmkit.VLMKitConfig.from_pretrained(tmp_path, connector_type="lstm")


@pytest.mark.parametrize("connector_type", CONNECTOR_TYPES)
def test_save_and_reload_keeps_the_connector(connector_type, tmp_path):
    cfg = vlmkit.VLMKitConfig(**tiny_connector_config_dict(connector_type, use_deepstack=False))
    cfg.save_pretrained(tmp_path)
    again = vlmkit.VLMKitConfig.from_pretrained(tmp_path)
    assert again.to_dict() == cfg.to_dict()
    assert again.connector_config.use_deepstack is False


def test_llava_alias_sets_the_mlp_depth():
    cfg = vlmkit.VLMKitConfig(**tiny_config_dict(connector_type="mlp3x_gelu"))
    assert (cfg.connector_type, cfg.connector_config.mlp_depth) == ("mlp", 3)


@pytest.mark.parametrize("overrides, message", [
    (dict(connector_type="merger", connector_config={"mrope_layout": "sequence"}),
     "mrope_layout 'sequence' is not available for connector_type 'merger'"),
    (dict(connector_type="mlp", connector_config={"mrope_layout": "sequence"}),
     "mrope_layout 'sequence' is not available for connector_type 'mlp'"),
    (dict(connector_type="qformer", connector_config={"mrope_layout": "diagonal"}),
     r"mrope_layout 'diagonal' is not one of \['grid', 'sequence'\]"),
    (dict(connector_type="qformer", connector_config={"query_grid": [3, 3]}),
     r"query_grid \(3, 3\) has 9 cells but num_queries is 32"),
    (dict(connector_type="resampler", connector_config={"num_latents": 0, "mlp_depth": 0}),
     r"connector settings must be at least 1: \{'mlp_depth': 0, 'num_latents': 0\}"),
    (dict(connector_type="qformer", connector_config={"qformer_hidden_size": 40}),
     "qformer_hidden_size 40 is not divisible by qformer_num_heads 12"),
    (dict(connector_type="resampler", connector_config={"resampler_num_key_value_heads": 3}),
     "resampler_num_heads 16 is not a multiple of resampler_num_key_value_heads 3"),
])
def test_bad_connector_settings_raise_value_errors_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        vlmkit.VLMKitConfig(**tiny_config_dict(**overrides))


def test_token_counts_per_connector():
    """A 448 x 448 image at patch 16 is grid (1, 28, 28); C.4's table with the reference defaults."""
    expected = {"merger": 196, "mlp": 784, "qformer": 32, "resampler": 64}
    for connector_type, count in expected.items():
        cfg = vlmkit.VLMKitConfig(connector_type=connector_type)
        assert num_visual_tokens((1, 28, 28), cfg) == count
        assert num_visual_tokens((4, 28, 28), cfg) == 4 * count  # one block per temporal slice
        assert tokens_per_temporal_slice((4, 28, 28), cfg) == count
    assert llm_grid_thw((2, 28, 28), vlmkit.VLMKitConfig(connector_type="qformer")) == (2, 4, 8)
    assert llm_grid_thw((2, 28, 28), vlmkit.VLMKitConfig(connector_type="resampler")) == (2, 8, 8)
    assert llm_grid_thw((2, 28, 28), vlmkit.VLMKitConfig(connector_type="mlp")) == (2, 28, 28)
    cfg = vlmkit.VLMKitConfig(connector_type="qformer", connector_config={"num_queries": 7})
    assert llm_grid_thw((1, 4, 4), cfg) == (1, 1, 7)  # a prime count is a 1 x Q grid


@pytest.mark.parametrize("connector_type", CONNECTOR_TYPES)
def test_flat_geometry_settings_give_the_same_counts(connector_type):
    cfg = vlmkit.VLMKitConfig(**tiny_connector_config_dict(connector_type))
    settings = geometry_settings(cfg)
    assert json.loads(json.dumps(settings)) == settings
    assert geometry_settings(settings) == settings
    natural = "grid" if connector_type in ("merger", "mlp") else "sequence"
    assert mrope_layout(settings) == mrope_layout(cfg) == natural
    for grid in [(1, 4, 6), (3, 8, 2), (2, 16, 10)]:
        assert num_visual_tokens(grid, settings) == num_visual_tokens(grid, cfg)
        assert llm_grid_thw(grid, settings) == llm_grid_thw(grid, cfg)
    with pytest.raises(ValueError, match=r"grid \(t=1, h=5, w=6\) is not divisible by spatial_merge_size 2"):
        num_visual_tokens((1, 5, 6), settings)


def test_registry_covers_every_connector_type():
    assert sorted(CONNECTORS) == sorted(CONNECTOR_TYPES)
    choices = r"\['merger', 'mlp', 'qformer', 'resampler'\]"
    with pytest.raises(ValueError, match=r"unknown connector_type 'lstm'; choose one of " + choices):
        build_connector("lstm", vlmkit.VLMKitVisionConfig())


def test_the_geometry_module_runs_without_torch():
    """The processor side imports it; it must not pull in torch (or transformers)."""
    import subprocess
    import sys

    from vlmkit.configuration import geometry

    code = ("import runpy, sys; g = runpy.run_path(sys.argv[1]); "
            "assert g['num_visual_tokens']((2, 8, 8), {'connector_type': 'qformer', 'num_queries': 6}) == 12; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, geometry.__file__], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

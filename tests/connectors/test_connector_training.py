"""Round trip, gradients, query initialisation and DeepStack switching, per connector (item 3)."""

import pytest
import torch
from helpers import batch_inputs, sample

import vlmkit

from .connector_testing import CONNECTOR_PREFIXES, QUERY_CONNECTORS, build_model


def _inputs(config):
    return batch_inputs([
        sample(2, config).text(3).image(4, 6).text(6),
        sample(4, config).text(3).video(2, 4, 4).text(2).image(8, 4).text(3),
    ])


def _labels(inputs):
    labels = inputs["input_ids"].masked_fill(inputs["mm_token_type_ids"] > 0, -100)
    return labels.masked_fill(inputs["attention_mask"] == 0, -100)


def _queries(model) -> list[torch.Tensor]:
    visual = model.model.visual
    return [getattr(connector, name) for connector in [visual.merger, *visual.deepstack_merger_list]
            for name in connector.learned_query_names]


def _min_pairwise_distance(queries: torch.Tensor) -> float:
    distances = torch.cdist(queries.detach()[None], queries.detach()[None])[0]  # (Q, Q)
    return distances.masked_fill(torch.eye(len(queries), dtype=torch.bool), float("inf")).min().item()


def test_save_and_reload_is_bit_exact(model, tmp_path):
    model.save_pretrained(tmp_path)
    again, info = vlmkit.VLMKitForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert again.config.connector_type == model.config.connector_type
    for field in vlmkit.VLMKitConnectorConfig.__annotations__:
        assert getattr(again.config.connector_config, field) == getattr(model.config.connector_config, field), field
    state = again.state_dict()
    assert state.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    inputs = _inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, again.eval()(**inputs).logits)


def test_one_training_step_reaches_every_connector_parameter(model):
    model.train()
    inputs = _inputs(model.config)
    model(**inputs, labels=_labels(inputs), use_cache=False).loss.backward()
    connector = {n: p for n, p in model.named_parameters() if n.startswith(CONNECTOR_PREFIXES)}
    assert len(connector) > 0 and any(n.startswith(CONNECTOR_PREFIXES[1]) for n in connector)
    for name, param in connector.items():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for queries in _queries(model):
        assert _min_pairwise_distance(queries) > 1e-3


@pytest.mark.parametrize("connector_type", QUERY_CONNECTORS)
def test_learned_queries_start_distinct_from_normal_0_002(connector_type):
    config = vlmkit.VLMKitConfig(**build_model(connector_type).config.to_dict())
    torch.manual_seed(0)
    model = vlmkit.VLMKitForConditionalGeneration(config)  # post_init's _init_weights, no perturbation
    queries = _queries(model)
    assert len(queries) == 4  # the main connector and 3 DeepStack levels
    values = torch.cat([q.detach().flatten() for q in queries])
    assert abs(values.mean().item()) < 0.005 and abs(values.std().item() - 0.02) < 0.002
    for q in queries:
        assert _min_pairwise_distance(q) > 1e-3


def test_deepstack_can_be_switched_off(connector_type):
    with_deepstack = build_model(connector_type)
    without = build_model(connector_type, use_deepstack=False)
    assert len(without.model.visual.deepstack_merger_list) == 0
    assert len(with_deepstack.model.visual.deepstack_merger_list) == 3
    # same weights except the DeepStack connectors: the logits must differ, so DeepStack is injected
    missing, unexpected = without.load_state_dict(with_deepstack.state_dict(), strict=False)
    assert missing == [] and {k.split(".")[2] for k in unexpected} == {"deepstack_merger_list"}
    inputs = _inputs(without.config)
    with torch.no_grad():
        features = without.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        off, on = without(**inputs).logits, with_deepstack(**inputs).logits
    assert features.deepstack_features is None
    real = inputs["attention_mask"].bool()
    assert (off - on)[real].abs().max().item() > 1e-3

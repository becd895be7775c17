"""M-RoPE layouts per connector, and the MLP connector's raster-order contract."""

import torch
from helpers import IMAGE, VIDEO, batch_inputs, sample

from vlmkit.configuration import mrope_layout
from vlmkit.modeling.connectors.mlp import MLPConnector
from vlmkit.modeling.vision_geometry import patch_coordinates, raster_order

from .connector_testing import build_model


def _positions(model, inputs):
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    return model.model.compute_position_ids(
        inputs["input_ids"], embeds, inputs["attention_mask"], inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), None,
    )


def test_sequence_layout_gives_query_tokens_text_positions():
    """t = h = w = start + k inside a block and the next token at start + N: positions are plain text ones."""
    for connector_type in ("qformer", "resampler"):
        model = build_model(connector_type)
        assert mrope_layout(model.config) == "sequence"
        samples = [sample(1, model.config).text(3).image(4, 6).text(2).video(2, 4, 4).text(3),
                   sample(2, model.config).text(2).image(8, 8).text(1)]
        inputs = batch_inputs(samples)
        positions = _positions(model, inputs)
        real = inputs["attention_mask"].bool()
        text_row = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0) * inputs["attention_mask"]
        for axis in range(1, 4):
            assert torch.equal(positions[axis][real], text_row[real]), (connector_type, axis)
        queries = {"qformer": 6, "resampler": 5}[connector_type]
        assert int((inputs["input_ids"] == IMAGE).sum()) == 2 * queries  # one block per image
        assert int((inputs["input_ids"] == VIDEO).sum()) == 2 * queries  # one block per temporal slice


def test_grid_layout_puts_queries_on_their_virtual_grid():
    model = build_model("qformer", mrope_layout="grid", query_grid=[2, 3])
    inputs = batch_inputs([sample(1, model.config).text(3).image(4, 6).text(2)])
    positions = _positions(model, inputs)[1:, 0]  # (3, S)
    start = 4  # 3 text tokens and <vision_start>
    block = positions[:, start:start + 6]
    assert block[0].tolist() == [4] * 6
    assert block[1].tolist() == [4, 4, 4, 5, 5, 5]
    assert block[2].tolist() == [4, 5, 6, 4, 5, 6]
    assert positions[:, start + 6].tolist() == [4 + 3] * 3  # <vision_end> at start + max(gh, gw)


def test_mlp_grid_layout_spans_every_patch():
    model = build_model("mlp")
    inputs = batch_inputs([sample(1, model.config).text(3).image(4, 6).text(2)])
    positions = _positions(model, inputs)[1:, 0]
    block = positions[:, 4:4 + 24]
    assert block[1].tolist() == [4 + r for r in range(4) for _ in range(6)]
    assert block[2].tolist() == [4 + c for _ in range(4) for c in range(6)]
    assert positions[:, 4 + 24].tolist() == [4 + 6] * 3


def test_raster_order_undoes_the_block_major_patch_order():
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    coords = patch_coordinates(grid, 2)[raster_order(grid, 2)]
    expected = [(r, c) for r in range(4) for c in range(6)] + 2 * [(r, c) for r in range(2) for c in range(4)]
    assert [tuple(x) for x in coords.tolist()] == expected


def test_mlp_connector_emits_patches_in_raster_order():
    """Features that carry their own (row, col) come out of a copying projector in raster order."""
    model = build_model("mlp", mlp_depth=1)
    connector = model.model.visual.merger
    assert isinstance(connector, MLPConnector)
    with torch.no_grad():
        linear = connector.projector[0]
        linear.weight.zero_()
        linear.bias.zero_()
        linear.weight[0, 0] = linear.weight[1, 1] = 1.0
    grid = torch.tensor([[1, 4, 6]])
    features = torch.zeros(24, linear.in_features)
    features[:, :2] = patch_coordinates(grid, 2).float()  # block-major (row, col), as the tower delivers them
    with torch.no_grad():
        out = connector(features, grid)
    assert out[:, :2].long().tolist() == [[r, c] for r in range(4) for c in range(6)]

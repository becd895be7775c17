"""3D M-RoPE positions against the reference's get_rope_index, and padding invariance."""

import torch
from helpers import batch_inputs, sample


def _cases():
    return [
        [sample(2).text(3).image(4, 6).text(4)],
        [sample(5).text(3).image(4, 6).text(1).video(3, 4, 4).text(4)],
        [sample(6).text(3).image(4, 6).text(4), sample(7).text(9), sample(8).text(2).image(6, 4).image(4, 4).text(3)],
    ]


def test_positions_equal_reference_get_rope_index(pair):
    ref, ours = pair
    for samples in _cases():
        inputs = batch_inputs(samples)
        expected, expected_deltas = ref.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"), inputs["attention_mask"],
        )
        embeds = ours.get_input_embeddings()(inputs["input_ids"])
        got = ours.model.compute_position_ids(
            inputs["input_ids"], embeds, inputs["attention_mask"], inputs["mm_token_type_ids"],
            inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), None,
        )
        assert torch.equal(got[1:], expected)
        text_row = inputs["attention_mask"].cumsum(-1) - 1
        assert torch.equal(got[0], text_row.clamp(min=0) * inputs["attention_mask"])


def test_positions_of_a_padded_row_equal_the_row_alone(pair):
    _, ours = pair
    samples = _cases()[2]
    batch = batch_inputs(samples)
    embeds = ours.get_input_embeddings()(batch["input_ids"])
    batched = ours.model.compute_position_ids(
        batch["input_ids"], embeds, batch["attention_mask"], None, batch["image_grid_thw"], None, None
    )
    for row, s in enumerate(samples):
        alone = batch_inputs([s])
        one = ours.model.compute_position_ids(
            alone["input_ids"], ours.get_input_embeddings()(alone["input_ids"]), None, None,
            alone.get("image_grid_thw"), None, None,
        )
        real = batch["attention_mask"][row].bool()
        assert torch.equal(batched[:, row, real], one[:, 0])

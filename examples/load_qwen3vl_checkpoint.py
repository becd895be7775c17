"""Load an official Qwen3-VL-layout checkpoint into vlmkit and compare it with transformers.

With no argument, builds a tiny random Qwen3-VL with transformers (no download), saves it, loads it
into `vlmkit.VLMKitForConditionalGeneration` and prints the largest logit difference and whether
greedy generations agree. With a path, uses that checkpoint (for example a local copy of
Qwen/Qwen3-VL-2B-Instruct) on a random image-sized input.

    python examples/load_qwen3vl_checkpoint.py [CHECKPOINT_DIR]
"""

import argparse
import tempfile

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

import vlmkit


def tiny_qwen3vl(path: str) -> None:
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                           out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2]),
        image_token_id=251, video_token_id=252, vision_start_token_id=253, vision_end_token_id=254,
    )
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(path)


def image_prompt(config, grid_h: int = 8, grid_w: int = 12) -> dict:
    """A prompt with one image of grid (1, grid_h, grid_w) patches and random pixels."""
    vision = config.vision_config
    tokens = grid_h * grid_w // vision.spatial_merge_size**2
    ids = [11, 12, 13, config.vision_start_token_id] + [config.image_token_id] * tokens + [config.vision_end_token_id, 14, 15]
    input_ids = torch.tensor([ids])
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == config.image_token_id).long(),
        "pixel_values": torch.randn(grid_h * grid_w, width),
        "image_grid_thw": torch.tensor([[1, grid_h, grid_w]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="Qwen3-VL-layout checkpoint folder (default: a tiny random one)")
    args = parser.parse_args()

    path = args.checkpoint or tempfile.mkdtemp(prefix="tiny-qwen3vl-")
    if args.checkpoint is None:
        tiny_qwen3vl(path)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    ours, info = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    ours.eval()
    print(f"loaded {type(ours).__name__}: missing={sorted(info['missing_keys'])} unexpected={sorted(info['unexpected_keys'])}")

    inputs = image_prompt(ours.config)
    with torch.no_grad():
        diff = (reference(**inputs).logits - ours(**inputs).logits).abs().max().item()
    print(f"max |logit difference| vs transformers' Qwen3-VL: {diff:.3g}")
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    same = torch.equal(reference.generate(**inputs, **kwargs), ours.generate(**inputs, **kwargs))
    print(f"greedy generation of 12 tokens identical: {same}")


if __name__ == "__main__":
    main()

"""Tiny configurations, reference models and hand-built multimodal inputs for the tests.

Everything is built locally: no download. The reference is transformers' own Qwen3-VL.
"""

import importlib.util
import os
import subprocess
import sys

import torch

from vlmkit.configuration import tokens_per_temporal_slice

IMAGE, VIDEO, VSTART, VEND = 251, 252, 253, 254
PAD = 0
EOS = 1
PATCH_WIDTH = 3 * 2 * 4 * 4  # C * T * P * P for the tiny vision config
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(folder: str, name: str):
    """A script of the repo's examples/ or benchmarks/ (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the environment of a script or CLI run in a process of its own: offline, and only transformers' errors
OFFLINE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def run_train_shapes(*args) -> subprocess.CompletedProcess:
    """`python examples/train_shapes.py ARGS...` in a process of its own, offline, as a user runs it."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_shapes.py"), *map(str, args)],
                          check=False, capture_output=True, text=True, timeout=600, env=OFFLINE_ENV)


def tiny_config_dict(tie_word_embeddings: bool = False, **overrides) -> dict:
    """Qwen3-VL-layout config small enough for CPU (qwen3vl_reference.md section 9).

    4 text layers > 3 DeepStack levels, so every DeepStack merger reaches the loss.
    """
    cfg = dict(
        text_config=dict(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2],
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie_word_embeddings,
    )
    cfg.update(overrides)
    return cfg


# Connector hyperparameters small enough for CPU; every connector kind reads its own fields.
TINY_CONNECTOR_CONFIG = dict(
    num_queries=6, qformer_hidden_size=32, qformer_num_layers=2, qformer_num_heads=2, qformer_intermediate_size=64,
    cross_attention_frequency=2,
    num_latents=5, resampler_depth=2, resampler_num_heads=4, resampler_head_dim=8, resampler_num_key_value_heads=2,
    resampler_intermediate_size=64,
)


def tiny_connector_config_dict(connector_type: str, **connector_overrides) -> dict:
    """tiny_config_dict with the given connector and TINY_CONNECTOR_CONFIG (plus overrides)."""
    return tiny_config_dict(
        connector_type=connector_type, connector_config={**TINY_CONNECTOR_CONFIG, **connector_overrides}
    )


def perturb_(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add noise to every parameter so norms and biases are not at their trivial init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * scale)
    return model


def reference_model(tie_word_embeddings: bool = False, seed: int = 0, **overrides):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**tiny_config_dict(tie_word_embeddings, **overrides)))
    perturb_(model, seed)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model.eval()


class Sample:
    """One prompt: token ids plus the images / videos its placeholders stand for (in order).

    Placeholder counts come from the token geometry of `config` (a VLMKitConfig or flat geometry
    settings); without one, from the merger's h * w / 4.
    """

    def __init__(self, gen: torch.Generator, config=None):
        self.gen = gen
        self.config = config
        self.ids: list[int] = []
        self.images: list[tuple[int, int, int]] = []
        self.videos: list[tuple[int, int, int]] = []
        self.image_pixels: list[torch.Tensor] = []
        self.video_pixels: list[torch.Tensor] = []

    def text(self, n: int) -> "Sample":
        self.ids += torch.randint(10, 240, (n,), generator=self.gen).tolist()
        return self

    def _tokens_per_slice(self, h: int, w: int) -> int:
        if self.config is None:
            return h * w // 4
        return tokens_per_temporal_slice((1, h, w), self.config)

    def image(self, h: int, w: int) -> "Sample":
        self.images.append((1, h, w))
        self.image_pixels.append(torch.randn(h * w, PATCH_WIDTH, generator=self.gen))
        self.ids += [VSTART] + [IMAGE] * self._tokens_per_slice(h, w) + [VEND]
        return self

    def video(self, t: int, h: int, w: int) -> "Sample":
        """Qwen3-VL 5.24 layout: outer <vs>...<ve> around per-slice `<ts> <vs> pads <ve>` blocks."""
        self.videos.append((t, h, w))
        self.video_pixels.append(torch.randn(t * h * w, PATCH_WIDTH, generator=self.gen))
        self.ids += [VSTART]
        for _ in range(t):
            self.text(2)  # stands for the "<x.y seconds>" timestamp text
            self.ids += [VSTART] + [VIDEO] * self._tokens_per_slice(h, w) + [VEND]
        self.ids += [VEND]
        return self


def batch_inputs(samples: list[Sample], dtype=torch.float32, padding_side: str = "left") -> dict:
    """Padded batch in the processor's format (pixel rows concatenated over the batch, in order)."""
    length = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        span = slice(length - len(s.ids), length) if padding_side == "left" else slice(0, len(s.ids))
        ids[i, span] = torch.tensor(s.ids)
        mask[i, span] = 1
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    out = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types}
    images = [g for s in samples for g in s.images]
    videos = [g for s in samples for g in s.videos]
    if images:
        out["image_grid_thw"] = torch.tensor(images)
        out["pixel_values"] = torch.cat([p for s in samples for p in s.image_pixels]).to(dtype)
    if videos:
        out["video_grid_thw"] = torch.tensor(videos)
        out["pixel_values_videos"] = torch.cat([p for s in samples for p in s.video_pixels]).to(dtype)
    return out


def sample(seed: int = 0, config=None) -> Sample:
    return Sample(torch.Generator().manual_seed(seed), config)


def tiny_vlmkit_config_for(tokenizer, **overrides):
    """The tiny config with the special-token ids of a tokenizer from vlmkit.build_tokenizer."""
    import vlmkit

    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    cfg = tiny_config_dict(image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2],
                           vision_end_token_id=ids[3], **overrides)
    cfg["text_config"]["vocab_size"] = max(len(tokenizer), 300)
    return vlmkit.VLMKitConfig(**cfg)

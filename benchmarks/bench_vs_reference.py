"""vlmkit against transformers' Qwen3-VL on the same weights, side by side in one process.

    python benchmarks/bench_vs_reference.py [--rounds 20] [--repeats 3] [--threads 2] [--dtype float32|bfloat16]

One fixed configuration (vision depth 6 / hidden 256 / 4 heads / intermediate 1024 / patch 16 /
DeepStack on 3 layers; text 6 layers / hidden 512 / 8 heads, 4 KV heads / head_dim 64 /
intermediate 1536 / vocab 8192) is saved once with random weights by transformers' Qwen3-VL and
loaded into both implementations. Every measurement is a pair of calls, one of each, back to back, in
an order that swaps every pair (ABBA: whichever runs second may find warmer caches or a busier
allocator); its ratio compares two calls a moment apart, so the slow spells of a shared VM hit both
sides. Each round makes --repeats pairs of each measure:
  prefill      one forward over 2 images of 448x448 (784 patches each) + 64 text tokens
  decode step  (generate 33 tokens - generate 1 token) / 32, greedy
  train step   forward + backward with labels
and, once, the peak memory allocated during a prefill (torch profiler memory events). Prints each
round's median pair ratio (vlmkit / reference), then the median times and the median ratio over all
pairs, checks the outputs agree, and writes JSON to benchmarks/results/.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

import vlmkit

IMAGE, VIDEO, VSTART, VEND = 8000, 8001, 8002, 8003
CONFIG = dict(
    text_config=dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10]}),
    vision_config=dict(depth=6, hidden_size=256, num_heads=4, intermediate_size=1024, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=512,
                       num_position_embeddings=2304, deepstack_visual_indexes=[1, 3, 5]),
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
)


def prefill_inputs(dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(10, 7000, (n,), generator=gen).tolist()  # noqa: E731
    ids = text(20) + [VSTART] + [IMAGE] * 196 + [VEND] + text(22) + [VSTART] + [IMAGE] * 196 + [VEND] + text(22)
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == IMAGE).long(),
        "pixel_values": torch.randn(2 * 784, 3 * 2 * 16 * 16, generator=gen).to(dtype),
        "image_grid_thw": torch.tensor([[1, 28, 28], [1, 28, 28]]),
    }


def timed(fn, synchronize=None) -> float:
    """Seconds fn takes; `synchronize` (e.g. torch.cuda.synchronize) waits for the device on both ends."""
    if synchronize:
        synchronize()
    start = time.perf_counter()
    fn()
    if synchronize:
        synchronize()
    return time.perf_counter() - start


def paired(models: dict, measure, pairs: int, first: int = 0) -> tuple[dict[str, list[float]], list[float]]:
    """`pairs` pairs of back-to-back calls `measure(model)`, one per implementation ("reference",
    "vlmkit"), in an order that swaps every pair (pair numbers count from `first`). Returns the
    values per implementation and the vlmkit / reference ratio of each pair."""
    values, ratios = {impl: [] for impl in models}, []
    for pair in range(first, first + pairs):
        order = list(models) if pair % 2 == 0 else list(models)[::-1]
        seconds = {impl: measure(models[impl]) for impl in order}
        for impl, value in seconds.items():
            values[impl].append(value)
        ratios.append(seconds["vlmkit"] / seconds["reference"])
    return values, ratios


def peak_memory(fn) -> int:
    """Peak bytes allocated by torch on the CPU while fn runs (running sum of allocation events)."""
    fn()  # warm: one-off allocations made before profiling would otherwise show as unmatched frees
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # self (not inclusive) usage: allocations are charged to the op that made them, frees are
    # "[memory]" events with negative sizes
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    running, peak = 0, 0
    for event in events:
        running += event.self_cpu_memory_usage
        peak = max(peak, running)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of calls per measure and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {platform.processor() or platform.machine()}")

    path = tempfile.mkdtemp(prefix="bench-qwen3vl-")
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**CONFIG)).save_pretrained(path)
    models = {
        "reference": Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval(),
        "vlmkit": vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, dtype=dtype).eval(),
    }
    inputs = prefill_inputs(dtype)
    labels = inputs["input_ids"].masked_fill(inputs["mm_token_type_ids"] > 0, -100)
    gen_kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def prefill(model):
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits

    def generate(model, n):
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **gen_kwargs)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        model(**inputs, labels=labels, use_cache=False).loss.backward()

    # the two must agree before their speed means anything
    ref_logits, our_logits = prefill(models["reference"]), prefill(models["vlmkit"])
    logit_diff = (ref_logits.float() - our_logits.float()).abs().max().item()
    same_tokens = torch.equal(generate(models["reference"], 33), generate(models["vlmkit"], 33))
    print(f"max |logit diff| {logit_diff:.2e}, identical greedy tokens: {same_tokens}")

    for model in models.values():  # warm-up
        prefill(model), generate(model, 2), train_step(model)
    measures = {"prefill": lambda m: timed(lambda: prefill(m)),
                "decode_step": lambda m: (timed(lambda: generate(m, 33)) - timed(lambda: generate(m, 1))) / 32,
                "train_step": lambda m: timed(lambda: train_step(m))}
    times = {name: {impl: [] for impl in models} for name in measures}
    ratios = {name: [] for name in measures}
    print(f"{'round':>5} " + " ".join(f"{name + ' ratio':>18}" for name in measures))
    for round_index in range(args.rounds):
        for name, measure in measures.items():
            values, pair_ratios = paired(models, measure, args.repeats, first=round_index * args.repeats)
            for impl in models:
                times[name][impl] += values[impl]
            ratios[name] += pair_ratios
        print(f"{round_index:>5} " + " ".join(
            f"{statistics.median(ratios[n][-args.repeats:]):>18.3f}" for n in measures))

    memory = {impl: peak_memory(lambda m=model: prefill(m)) for impl, model in models.items()}
    summary = {}
    print("\n| measure | reference | vlmkit | vlmkit / reference |\n|---|---|---|---|")
    for name in measures:
        ref, ours = (statistics.median(times[name][impl]) for impl in ("reference", "vlmkit"))
        ratio = statistics.median(ratios[name])
        summary[name] = {"reference_ms": ref * 1e3, "vlmkit_ms": ours * 1e3, "median_ratio": ratio}
        print(f"| {name} | {ref * 1e3:.1f} ms | {ours * 1e3:.1f} ms | {ratio:.3f} |")
    print(f"| prefill peak memory | {memory['reference'] / 2**20:.1f} MiB | {memory['vlmkit'] / 2**20:.1f} MiB | "
          f"{memory['vlmkit'] / memory['reference']:.3f} |")

    os.makedirs(args.out, exist_ok=True)
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(), "rounds": args.rounds, "repeats": args.repeats,
              "torch": torch.__version__, "logit_max_abs_diff": logit_diff, "same_greedy_tokens": same_tokens,
              "summary": summary, "prefill_peak_bytes": memory,
              "per_call_seconds": times, "pair_ratios": ratios}
    out_file = os.path.join(args.out, f"bench_vs_reference_{args.dtype}.json")
    with open(out_file, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()

"""The GPU checks of the performance issue, as one script for a lent GPU machine.

    python benchmarks/gpu_checks.py                                   # on CUDA: flash_attention_2 vs sdpa, bf16
    python benchmarks/gpu_checks.py --device cpu --dtype float32 --attn eager --rounds 2 --batches 1 2   # CPU smoke run

1. Agreement: vlmkit with `--attn` (flash_attention_2 by default) in both towers against vlmkit with
   sdpa, on the benchmark configuration of bench_vs_reference.py and its 2-image prefill: the cosine
   of every position's logits (at least 0.999 to pass) and the greedy tokens of a 33-token generate.
2. Speed against transformers' Qwen3-VL (both with `--attn`), at each batch size in --batches: the
   prefill, and the decode step ((generate 33 - generate 1) / 32), timed with the device synchronised,
   as pairs of adjacent calls whose order swaps every pair; medians of the pair ratios.
Writes benchmarks/results/gpu_checks_<device>.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

sys.path.insert(0, os.path.dirname(__file__))
from bench_vs_reference import CONFIG, paired, prefill_inputs, timed  # noqa: E402

import vlmkit  # noqa: E402


def batched(inputs: dict, batch: int, device: str) -> dict:
    """The 2-image prefill repeated `batch` times (every row has the same length: no padding); the
    patch rows and grids repeat along their first dim like the token rows."""
    return {key: value.repeat(batch, 1).to(device) for key, value in inputs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attn", default="flash_attention_2", help="implementation checked against sdpa")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), args.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    print(f"torch {torch.__version__}, {name}, {args.dtype}, {args.attn} vs sdpa")

    path = tempfile.mkdtemp(prefix="gpu-checks-")
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(**CONFIG)).save_pretrained(path)
    load = lambda cls, attn: cls.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()  # noqa: E731
    ours = load(vlmkit.VLMKitForConditionalGeneration, args.attn)
    ours_sdpa = load(vlmkit.VLMKitForConditionalGeneration, "sdpa")
    reference = load(Qwen3VLForConditionalGeneration, args.attn)
    for model in (ours, ours_sdpa):
        implementations = {model.model.visual.config._attn_implementation, model.model.language_model.config._attn_implementation}
        print(f"  towers use {implementations}")
    gen_kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    base = prefill_inputs(dtype)

    with torch.no_grad():
        inputs = batched(base, 1, device)
        logits, logits_sdpa = (m(**inputs, use_cache=False).logits.float()[0] for m in (ours, ours_sdpa))
        cosine = torch.nn.functional.cosine_similarity(logits, logits_sdpa, dim=-1).min().item()
        tokens, tokens_sdpa = (m.generate(**inputs, max_new_tokens=33, min_new_tokens=33, **gen_kwargs) for m in (ours, ours_sdpa))
        same_tokens = torch.equal(tokens, tokens_sdpa)
    agreement = {"min_logit_cosine": cosine, "same_greedy_tokens": same_tokens, "passes": cosine >= 0.999 and same_tokens}
    print(f"agreement with sdpa: min logit cosine {cosine:.5f}, same greedy tokens {same_tokens}")

    def prefill(model, inputs):
        with torch.no_grad():
            model(**inputs, use_cache=False)

    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def decode_step(model, inputs):
        with torch.no_grad():
            long = timed(lambda: model.generate(**inputs, max_new_tokens=33, min_new_tokens=33, **gen_kwargs), sync)
            short = timed(lambda: model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, **gen_kwargs), sync)
        return (long - short) / 32

    speed = {}
    models = {"reference": reference, "vlmkit": ours}
    for batch in args.batches:
        inputs = batched(base, batch, device)
        measures = {"prefill": lambda m: timed(lambda: prefill(m, inputs), sync), "decode_step": lambda m: decode_step(m, inputs)}
        for model in models.values():  # warm-up
            prefill(model, inputs), decode_step(model, inputs)
        for measure_name, measure in measures.items():
            times, ratios = paired(models, measure, args.rounds)
            row = {f"{impl}_ms": statistics.median(values) * 1e3 for impl, values in times.items()}
            row["median_ratio"] = statistics.median(ratios)
            speed[f"batch{batch}/{measure_name}"] = row
            print(f"batch {batch:>3} {measure_name:<12} reference {row['reference_ms']:9.2f} ms  "
                  f"vlmkit {row['vlmkit_ms']:9.2f} ms  ratio {row['median_ratio']:.3f}")

    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"gpu_checks_{device.split(':')[0]}.json")
    with open(out_file, "w") as handle:
        json.dump({"device": name, "dtype": args.dtype, "attn": args.attn, "torch": torch.__version__,
                   "agreement": agreement, "speed": speed}, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()

"""Stage 2's step time in length-sorted micro-batches (train_shapes.py --micro-batches), side by side.

The same curriculum batches of the full-size ShapesWorld model go through forward and backward
(`per_sample_loss`, the loss stage 2 uses; the optimizer step, the same either way, is left out) once
whole and once in N micro-batches sorted by length (`LengthSortedSteps`), alternating, so that both
see the same machine state. Reports seconds per step, the ratio, and the share of the padded token
grid that holds real tokens, also for whole batches of the opening and the curriculum's earlier levels.

    python benchmarks/micro_batch_speed.py --json benchmarks/results/micro_batch_speed.json
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_shapes  # noqa: E402

from vlmkit.training import VLMKitDataCollator, per_sample_loss  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def step(model, collator, micro_batches: list[list[dict]]) -> tuple[float, int, int]:
    """Seconds for one step's forward and backward over `micro_batches`, its real and padded tokens."""
    start, real, padded = time.perf_counter(), 0, 0
    for samples in micro_batches:
        batch = collator(samples)
        labels = batch.pop("labels")
        real, padded = real + int(batch["attention_mask"].sum()), padded + batch["attention_mask"].numel()
        (per_sample_loss(model(**batch), labels) / len(micro_batches)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, real, padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batches", default="2,4", help="the splits to time against the whole batch")
    parser.add_argument("--steps", type=int, default=6, help="batches timed for each split")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join((*train_shapes.TASKS, train_shapes.CENTRE)),
                        help="the stream's tasks (train_shapes.py's default --tasks)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    splits = [1, *map(int, args.micro_batches.split(","))]
    uneven = [n for n in splits if n < 1 or args.batch_size % n]
    if uneven:
        parser.error(f"--micro-batches: {','.join(map(str, uneven))} cannot split --batch-size {args.batch_size} evenly")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tokenizer = train_shapes.shapes_tokenizer()
    model, processor = train_shapes.build_model_and_processor(tokenizer, smoke=False)
    model.config.use_cache = False
    model.train()
    collator = VLMKitDataCollator(processor)
    # the curriculum's last level: captions and boxes beside one-word answers, where padding is worst
    tasks, groups = tuple(args.tasks.split(",")), dict(existence_group=8, position_group=8, centre_group=4)
    ShapesStream = train_shapes.ShapesStream
    stream = ShapesStream(args.batch_size * 100, 0, False, tasks, **groups)  # train_shapes' default groups
    start = args.batch_size * 75
    sorter = train_shapes.LengthSortedSteps(stream, args.batch_size, processor)
    samples = list(itertools.islice(stream, start, start + args.batch_size * (args.steps + 1)))
    batches = [samples[i:i + args.batch_size] for i in range(0, len(samples), args.batch_size)]

    step(model, collator, [batches[0]])  # warm-up, untimed
    times, fill = {n: [] for n in splits}, {n: [0, 0] for n in splits}
    for batch in batches[1:]:
        ordered = sorted(batch, key=sorter.length)
        for n in splits:
            size = args.batch_size // n
            seconds, real, padded = step(model, collator, [ordered[i:i + size] for i in range(0, args.batch_size, size)]
                                         if n > 1 else [batch])
            times[n].append(seconds)
            fill[n][0] += real
            fill[n][1] += padded

    # how padded whole batches are in the other phases (not timed): the opening's one-word answers, and
    # the curriculum's first level (at 10% of it) and second (at 40%); the timed batches are its last
    opening = ShapesStream(args.batch_size * 4, 0, False, tasks, opening_samples=args.batch_size * 4, **groups)
    phases = {"opening": iter(opening),
              "curriculum_level_0": itertools.islice(stream, args.batch_size * 10, None),
              "curriculum_level_1": itertools.islice(stream, args.batch_size * 40, None)}
    phase_fill = {}
    for phase, samples in phases.items():
        real = padded = 0
        for mask in (collator(list(itertools.islice(samples, args.batch_size)))["attention_mask"] for _ in range(4)):
            real, padded = real + int(mask.sum()), padded + mask.numel()
        phase_fill[phase] = round(real / padded, 3)

    whole = statistics.median(times[1])
    results = {"cpu": cpu_name(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
               "batch_size": args.batch_size, "steps": args.steps,
               "splits": {str(n): {"seconds_per_step": round(statistics.median(times[n]), 3),
                                   "speedup": round(whole / statistics.median(times[n]), 3),
                                   "real_token_share": round(fill[n][0] / fill[n][1], 3)} for n in splits},
               "whole_batch_real_token_share_by_phase": {**phase_fill, "curriculum_level_2": round(fill[1][0] / fill[1][1], 3)}}
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

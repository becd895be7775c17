"""Train each of the four connectors with the same budget on ShapesWorld and compare them.

    python examples/compare_connectors.py --steps 400           # the README's run, about 25 min on 2 cores
    python examples/compare_connectors.py --steps 20 --eval 14  # a quick look

Every connector gets the same tokenizer, the same small model and processor around it
(examples/train_shapes.py's `build_model_and_processor`, the connector scaled to that width), the
same seed, data, optimiser and number of steps, on the easy curriculum level (128 px, 1-2 shapes,
plain background) and the one-word tasks. Accuracy is greedy generation graded like `vlmkit eval`,
on validation questions, with the image and with a blank one. Writes `compare_connectors.md` (a table) and `compare_connectors.png` (a bar chart
drawn with Pillow) under benchmarks/results/.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_shapes import SMALL_CONNECTORS, build_model_and_processor, tokenizer_corpus  # noqa: E402

import vlmkit  # noqa: E402
from vlmkit.cli import answer_samples  # noqa: E402
from vlmkit.configuration import num_visual_tokens  # noqa: E402
from vlmkit.data import as_messages, blank_like, grade, make_sample  # noqa: E402
from vlmkit.training import VLMKitDataCollator, component_of, component_prefixes, per_sample_loss  # noqa: E402

TASKS = ("count", "colour", "existence", "position")
EASY = {"difficulty": 0}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks", "results")


def train(model, processor, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Plain AdamW loop (the train_shapes recipe); returns the seconds of each step."""
    collator = VLMKitDataCollator(processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    step_seconds = []
    for step in range(steps):
        start = time.perf_counter()
        rows = [make_sample(seed * 10_000_019 + step * batch_size + i, task=TASKS[i % len(TASKS)], **EASY)
                for i in range(batch_size)]
        batch = collator([{"messages": as_messages(s), "fps": s["fps"]} for s in rows])
        labels = batch.pop("labels")
        loss = per_sample_loss(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        step_seconds.append(time.perf_counter() - start)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:>4}  loss {loss.item():.3f}", flush=True)
    return step_seconds


def accuracy(model, processor, samples: list[dict]) -> float:
    model.eval()
    answers = answer_samples(model, processor, samples, batch_size=32, max_new_tokens=8)
    return sum(grade(s["task"], a, s["answer"]) for s, a in zip(samples, answers)) / len(samples)


def parameter_counts(model) -> dict[str, int]:
    prefixes = component_prefixes(model)
    counts = {"total": 0, "connector": 0}
    for name, parameter in model.named_parameters():
        counts["total"] += parameter.numel()
        counts["connector"] += parameter.numel() * (component_of(name, prefixes) == "connector")
    return counts


def bar_chart(rows: list[dict], path: str) -> None:
    """One panel per measure, one bar per connector (Pillow only: no plotting dependency)."""
    panels = [("accuracy (image)", "accuracy", "{:.0%}"), ("accuracy (blank image)", "blank_accuracy", "{:.0%}"),
              ("visual tokens per 128x128 image", "visual_tokens", "{}"), ("step time (s)", "step_seconds", "{:.2f}"),
              ("parameters (M)", "parameters_m", "{:.2f}")]
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    panel_w, panel_h, margin = 260, 220, 30
    image = Image.new("RGB", (panel_w * len(panels), panel_h + 2 * margin), "white")
    draw = ImageDraw.Draw(image)
    for p, (title, key, fmt) in enumerate(panels):
        x0 = p * panel_w + 20
        top = max(max(r[key] for r in rows), 1e-9)
        draw.text((x0, 8), title, fill="black")
        bar_w = (panel_w - 50) // len(rows)
        for i, row in enumerate(rows):
            height = int((panel_h - 40) * row[key] / top)
            left, bottom = x0 + i * bar_w, margin + panel_h - 20
            draw.rectangle([left + 4, bottom - height, left + bar_w - 4, bottom], fill=colours[i % len(colours)])
            draw.text((left + 4, bottom - height - 12), fmt.format(row[key]), fill="black")
            draw.text((left + 4, bottom + 4), row["connector"], fill="black")
    image.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval", type=int, default=120, help="validation questions per connector")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tokenizer = vlmkit.build_tokenizer(tokenizer_corpus(2000), vocab_size=512)
    samples = [make_sample(i, task=TASKS[i % len(TASKS)], split="validation", **EASY) for i in range(args.eval)]
    rows = []
    for connector in SMALL_CONNECTORS:
        print(f"{connector}:", flush=True)
        torch.manual_seed(0)  # the same initial weights wherever the parameter shapes agree
        model, processor = build_model_and_processor(tokenizer, smoke=False, connector_type=connector)
        seconds = train(model, processor, args.steps, args.batch_size, args.lr, args.seed)
        counts = parameter_counts(model)
        rows.append({
            "connector": connector,
            "accuracy": accuracy(model, processor, samples),
            "blank_accuracy": accuracy(model, processor, [blank_like(s) for s in samples]),
            "visual_tokens": num_visual_tokens((1, 8, 8), model.config),  # 128x128 px = 8x8 patches of 16
            "step_seconds": statistics.median(seconds),
            "parameters_m": counts["total"] / 1e6,
            "connector_parameters_m": counts["connector"] / 1e6,
        })
        print(f"  {json.dumps(rows[-1])}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    lines = [f"Connectors on ShapesWorld ({', '.join(TASKS)}; 128 px, 1-2 shapes), {args.steps} steps of batch "
             f"{args.batch_size} each, lr {args.lr}, seed {args.seed}, {torch.get_num_threads()} threads; accuracy "
             f"on {args.eval} validation questions (greedy, graded as `vlmkit eval`).", "",
             "| connector | accuracy | blank image | visual tokens / 128x128 image | step time | parameters | "
             "of which connector |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['connector']} | {r['accuracy']:.1%} | {r['blank_accuracy']:.1%} | {r['visual_tokens']} | "
                     f"{r['step_seconds']:.2f} s | {r['parameters_m']:.2f} M | {r['connector_parameters_m']:.2f} M |")
    with open(os.path.join(args.out, "compare_connectors.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "compare_connectors.json"), "w") as handle:
        json.dump({"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                   "tasks": TASKS, "eval_questions": args.eval, "rows": rows}, handle, indent=1)
    bar_chart(rows, os.path.join(args.out, "compare_connectors.png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

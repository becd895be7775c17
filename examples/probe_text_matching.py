"""Can a fresh language model learn to check a question against a scene described in words?

    python examples/probe_text_matching.py --group 1 --json one.json     # one question per scene
    python examples/probe_text_matching.py --group 4 --json four.json    # minimal pairs (~8 min each)

Trains the shipped model's language model (same size, fresh weights, no vision) on existence
questions about described scenes ("A small red circle and a large blue star on a plain background.
Is there a red star?"), as `examples/train_shapes.py` does in its text warm-up, and prints every
--eval-every steps the exact-match rate on validation scenes of one and of three shapes, split by
the truth: "yes", "no" with the colour changed, "no" with the kind changed (one shape), "no" with
both a shape of that colour and one of that kind in the scene (three shapes). A model that does not
check the question stays at a constant answer; one that checks the colour only gets the
colour-changed "no"s right and not the kind-changed ones.

--group 4 gives existence as `vlmkit.data.existence_questions`: four questions about one scene side
by side in the batch, half "yes" and half one word off, so the answer prior cancels and only the
match lowers the loss. This is the experiment behind --existence-group in train_shapes.py.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_shapes  # noqa: E402  (the example next to this one: tokenizer, model and data stream)

from vlmkit.data import as_described_messages, make_sample  # noqa: E402
from vlmkit.training import VLMKitDataCollator, per_sample_loss  # noqa: E402


def truth_kind(sample: dict) -> str:
    """"yes", or which word of a "no" question differs from the shape in the scene sharing the other."""
    if sample["answer"] == "yes":
        return "yes"
    asked = sample["query"]
    shares_colour = any(s["colour"] == asked["colour"] for s in sample["scene"]["shapes"])
    shares_kind = any(s["kind"] == asked["kind"] for s in sample["scene"]["shapes"])
    return {(True, False): "no_kind_changed", (False, True): "no_colour_changed"}.get((shares_colour, shares_kind), "no_both")


def validation_questions(per_count: int) -> dict[int, list[dict]]:
    return {n: [make_sample(i, task="existence", split="validation", difficulty=1, min_shapes=n, max_shapes=n)
                for i in range(per_count)] for n in (1, 3)}


def evaluate(model, collator, validation: dict[int, list[dict]]) -> dict[str, float]:
    row = {}
    for count, samples in validation.items():
        hits = train_shapes.exact_match_batched(model, collator, samples, as_described_messages).tolist()
        row[f"{count}_shapes"] = round(sum(hits) / len(hits), 3)
        for kind in ("yes", "no_colour_changed", "no_kind_changed", "no_both"):
            chosen = [h for h, s in zip(hits, samples) if truth_kind(s) == kind]
            if chosen:
                row[f"{count}_shapes/{kind}"] = round(sum(chosen) / len(chosen), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", type=int, default=4, help="existence questions per scene, side by side (1 or even)")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--per-count", type=int, default=64, help="validation questions per shape count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, a few steps (the test)")
    parser.add_argument("--json", help="also write the curve here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tokenizer = train_shapes.shapes_tokenizer(args.smoke)
    model, processor = train_shapes.build_model_and_processor(tokenizer, args.smoke)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    collator = VLMKitDataCollator(processor)
    # every sample a described scene (text_samples covers the whole run), existence only
    stream = iter(train_shapes.ShapesStream(args.steps * args.batch_size, seed=0, smoke=False, tasks=("existence",),
                                            text_samples=args.steps * args.batch_size, existence_group=args.group))
    validation = validation_questions(args.per_count)
    curve, start = [], time.time()
    model.train()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50)  # linear warm-up, then constant: a probe, not a recipe
        batch = collator([next(stream) for _ in range(args.batch_size)])
        labels = batch.pop("labels")
        loss = per_sample_loss(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            row = {"step": step, "minutes": round((time.time() - start) / 60, 2), "loss": round(loss.item(), 4),
                   **evaluate(model, collator, validation)}
            curve.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"group": args.group, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                       "curve": curve}, handle, indent=1)


if __name__ == "__main__":
    main()

"""The `vlmkit` command: `vlmkit demo | chat | eval` on the bundled ShapesWorld model (or --model PATH).

    vlmkit demo                                  bundled sample images and a video: question, answer, truth
    vlmkit chat --image PATH [--video PATH] "question"   (no question: an interactive prompt)
    vlmkit eval [--split test] [--num 700] [--json]      per-task accuracy, blank-image and majority baselines,
                                                         caption novelty (--json: each question's grade too)
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict

DEMO_SEEDS = {"caption": 11, "count": 12, "colour": 13, "existence": 14, "position": 15, "grounding": 16, "motion": 17}


def default_model_path() -> str:
    """Folder of the small ShapesWorld model that ships inside the package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"no model at {path}: train it with `python examples/train_shapes.py --out {path}`"
        )
    return path


def use_cpu_threads() -> None:
    """Up to 4 threads: the bundled model is small, more only adds synchronisation."""
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def load(model_path: str | None):
    import torch

    import vlmkit

    path = model_path or default_model_path()
    use_cpu_threads()
    # the checkpoint is stored in bf16 (half the size); float32 is faster on most CPUs and matches training
    model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = vlmkit.VLMKitProcessor.from_pretrained(path)
    return model, processor


def answer_samples(model, processor, samples: list[dict], batch_size: int = 16, max_new_tokens: int = 48,
                   progress: bool = False) -> list[str]:
    """Greedy answers for ShapesWorld samples (their messages without the answer), batched."""
    import torch

    from vlmkit.data import as_messages

    answers = []
    batches = range(0, len(samples), batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="answering", unit="batch")
    for start in batches:
        chunk = samples[start:start + batch_size]
        conversations = [as_messages(s, include_answer=False) for s in chunk]
        fps = [{"fps": s["fps"]} for s in chunk if s.get("video")]
        kwargs = {"video_metadata": fps} if fps else {}
        inputs = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt",
                                               processor_kwargs={"padding": True, **kwargs})
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers += processor.post_process_image_text_to_text(out[:, inputs["input_ids"].shape[1]:])
    return [a.strip() for a in answers]


EXISTENCE_CASES = ("present", "colour_and_kind_apart", "colour_only", "kind_only", "neither")
COUNT_VARIANTS = ("all", "colour", "kind")  # a count question's query["variant"]: every shape, one colour, one kind


def existence_case(sample: dict) -> str:
    """What an existence question's truth turns on: "present", or for an absent shape what the scene
    holds of it. "colour_and_kind_apart" (its colour on one shape, its kind on another) is the case
    only binding the two words answers; "colour_only" and "kind_only" a model reading one word does."""
    query, shapes = sample["query"], sample["scene"]["shapes"]
    if query["present"]:
        return "present"
    colour = any(s["colour"] == query["colour"] for s in shapes)
    kind = any(s["kind"] == query["kind"] for s in shapes)
    return {(True, True): "colour_and_kind_apart", (True, False): "colour_only", (False, True): "kind_only",
            (False, False): "neither"}[colour, kind]


def accuracy_by(hits: list[bool], keys: list, order) -> tuple[dict[str, float], dict[str, int]]:
    """Accuracy and question count of each group of `hits` (grouped by `keys`), keyed by str(key), in
    `order`; groups without a question are left out."""
    groups = defaultdict(list)
    for hit, key in zip(hits, keys):
        groups[key].append(hit)
    present = [key for key in order if groups[key]]
    return ({str(k): round(sum(groups[k]) / len(groups[k]), 4) for k in present},
            {str(k): len(groups[k]) for k in present})


def evaluate(model, processor, split: str = "test", num: int = 700, seed: int = 0, progress: bool = True,
             novelty_reference: int = 20000) -> dict:
    """Accuracy per task (grounding: mean IoU and accuracy at IoU >= 0.5), on seen and held-out
    combinations; the same questions on a blank image; the majority-answer rate; caption novelty."""
    from vlmkit.data import (
        CAPTION_FIELDS, HELDOUT_COMBOS, TASKS, blank_like, box_errors, caption_field_hits, caption_of, grade, iou,
        majority_answers, make_sample, parse_box, parse_caption,
    )

    heldout_num = num // 3 if split == "test" else 0
    samples = [make_sample(seed * 1_000_003 + i, task=TASKS[i % len(TASKS)], split=split)
               for i in range(num - heldout_num)]
    samples += [make_sample(seed * 1_000_003 + i, task=TASKS[i % len(TASKS)], split=split, heldout=True)
                for i in range(heldout_num)]
    start = time.time()
    predictions = answer_samples(model, processor, samples, progress=progress)
    blank_predictions = answer_samples(model, processor, [blank_like(s) for s in samples], progress=progress)
    majority = majority_answers(samples)

    # what identifies the questions asked (pixels, question, answer), so that two reports are compared
    # question by question only when they asked the same ones (benchmarks/ship_check.py)
    asked = hashlib.sha1("\n".join(f"{s['hash']} {s['question']} {s['answer']}" for s in samples).encode()).hexdigest()
    report = {"split": split, "num_samples": len(samples), "seed": seed, "questions_sha1": asked,
              "seconds": round(time.time() - start, 1), "tasks": {}}
    by_task = defaultdict(list)
    for sample, prediction, blank in zip(samples, predictions, blank_predictions):
        by_task[sample["task"]].append((sample, prediction, blank))
    for task in TASKS:
        rows = by_task.get(task, [])
        if not rows:
            continue
        entry = {"n": len(rows), "majority_answer": majority[task][0], "majority_rate": round(majority[task][1], 4)}
        hits = [grade(task, p, s["answer"]) for s, p, _ in rows]
        for name, subset in (("seen", [h for h, r in zip(hits, rows) if not r[0]["heldout"]]),
                             ("heldout", [h for h, r in zip(hits, rows) if r[0]["heldout"]])):
            if subset:
                entry[f"accuracy_{name}"] = round(sum(subset) / len(subset), 4)
        entry["accuracy"] = round(sum(hits) / len(hits), 4)
        # each question's grade, in the order asked: two models' reports on the same questions can then be
        # compared pair by pair, with a smaller standard error than their accuracies (24-39% smaller between
        # two runs of one recipe: benchmarks/ship_check.py prints both)
        entry["hits"] = "".join("1" if hit else "0" for hit in hits)
        # by the number of shapes in the scene: a model that sees colours but not kinds answers a
        # colour question about 1 shape right and one about 2 shapes at chance between their colours
        shape_counts = [len(s["scene"]["shapes"]) for s, _, _ in rows]
        entry["accuracy_by_shapes"], entry["n_by_shapes"] = accuracy_by(hits, shape_counts, sorted(set(shape_counts)))
        if task == "existence":
            cases = [existence_case(s) for s, _, _ in rows]
            entry["accuracy_by_case"], entry["n_by_case"] = accuracy_by(hits, cases, EXISTENCE_CASES)
        if task == "count":
            # "How many shapes?" reads the scene as a whole; "How many red shapes?" must also find what
            # the question names, which is where a model answering from the shape count alone fails
            variants = [s["query"]["variant"] for s, _, _ in rows]
            entry["accuracy_by_variant"], entry["n_by_variant"] = accuracy_by(hits, variants, COUNT_VARIANTS)
        entry["blank_accuracy"] = round(sum(grade(task, b, s["answer"]) for s, _, b in rows) / len(rows), 4)
        if task == "grounding":
            ious = [iou(parse_box(p), parse_box(s["answer"])) for s, p, _ in rows]
            entry["mean_iou"] = round(sum(ious) / len(ious), 4)
            entry["ious"] = [round(value, 4) for value in ious]
            entry["blank_mean_iou"] = round(
                sum(iou(parse_box(b), parse_box(s["answer"])) for s, _, b in rows) / len(rows), 4)
            # how the boxes miss: placed wrong (centre distance, 0..1000 frame) or sized wrong (1: right)
            errors = [e for s, p, _ in rows if (e := box_errors(p, s["answer"])) is not None]
            entry["boxes_parsed"] = round(len(errors) / len(rows), 4)
            if errors:
                entry["median_centre_error"] = round(statistics.median(c for c, _ in errors), 1)
                entry["median_size_ratio"] = round(statistics.median(r for _, r in errors), 3)
        if task == "caption":
            training = {caption_of(make_sample(i, task="caption", split="train")["scene"])
                        for i in range(novelty_reference)}
            generated = [p for _, p, _ in rows]
            entry["caption_in_training_set"] = round(sum(p in training for p in generated) / len(generated), 4)
            entry["caption_novelty"] = round(1 - entry["caption_in_training_set"], 4)
            # where the captions go wrong: the share right of each field (every true shape's size,
            # colour and kind against the predicted shape at its place in the list)
            fields, kind_hits, pairs, scene_sizes = defaultdict(list), [], [], []
            for s, p, _ in rows:
                hits_by_field = caption_field_hits(p, s["answer"])
                for field, field_hits in hits_by_field.items():
                    fields[field] += field_hits
                kind_hits += hits_by_field["kind"]
                true_shapes = parse_caption(s["answer"])[0]
                pairs += ["heldout" if (colour, kind) in HELDOUT_COMBOS else "seen" for _, colour, kind in true_shapes]
                scene_sizes += [len(true_shapes)] * len(true_shapes)
            entry["field_accuracy"] = {f: round(sum(fields[f]) / len(fields[f]), 4) for f in CAPTION_FIELDS}
            # the kind of each true shape, split by whether its colour-kind pair was ever in training: a
            # language model that learned which kinds follow a colour word in the training captions
            # writes a seen pair's kind where the image shows a held-out pair
            entry["kind_accuracy_by_pair"], entry["n_kind_by_pair"] = accuracy_by(kind_hits, pairs, ("seen", "heldout"))
            # and by the shapes in the scene: in a scene of one shape the colour word names the shape to
            # describe, in a scene of several it must also bind the kind to the right one of them
            entry["kind_accuracy_by_pair_and_shapes"], entry["n_kind_by_pair_and_shapes"] = accuracy_by(
                kind_hits, [f"{pair} {n}" for pair, n in zip(pairs, scene_sizes)],
                [f"{pair} {n}" for pair in ("seen", "heldout") for n in sorted(set(scene_sizes))])
        report["tasks"][task] = entry
    return report


def format_report(report: dict) -> str:
    lines = [f"ShapesWorld {report['split']} split, {report['num_samples']} questions ({report['seconds']} s)",
             "| task | accuracy | seen | held-out | blank image | majority rate | notes |", "|---|---|---|---|---|---|---|"]
    for task, e in report["tasks"].items():
        notes = []
        if "mean_iou" in e:
            notes.append(f"mean IoU {e['mean_iou']:.3f} (blank {e['blank_mean_iou']:.3f})")
        if "median_centre_error" in e:
            notes.append(f"box centres off by {e['median_centre_error']:.0f} / 1000, sides x{e['median_size_ratio']:.2f} (medians)")
        if "caption_novelty" in e:
            notes.append(f"{e['caption_in_training_set']:.0%} of captions occur in training")
        if "field_accuracy" in e:
            notes.append("fields right: " + ", ".join(f"{f.replace('_', ' ')} {v:.0%}" for f, v in e["field_accuracy"].items()))
        if "kind_accuracy_by_pair" in e:
            notes.append("kinds right in colour-kind pairs " + ", ".join(
                f"{pair.replace('heldout', 'held out')} {v:.0%} ({e['n_kind_by_pair'][pair]} shapes)"
                for pair, v in e["kind_accuracy_by_pair"].items()))
        if "kind_accuracy_by_pair_and_shapes" in e:
            notes.append("by pair and shapes in the scene " + ", ".join(
                f"{key.replace('heldout', 'held out')} {v:.0%} ({e['n_kind_by_pair_and_shapes'][key]})"
                for key, v in e["kind_accuracy_by_pair_and_shapes"].items()))
        cell = lambda k: f"{e[k]:.1%}" if k in e else "-"  # noqa: E731
        lines.append(f"| {task} | {cell('accuracy')} | {cell('accuracy_seen')} | {cell('accuracy_heldout')} | "
                     f"{cell('blank_accuracy')} | {e['majority_rate']:.1%} | {'; '.join(notes)} |")
    counts = sorted({int(n) for e in report["tasks"].values() for n in e["accuracy_by_shapes"]})
    lines += ["", "Accuracy by the number of shapes in the scene (questions):",
              "| task | " + " | ".join(f"{n} shape{'s' * (n > 1)}" for n in counts) + " |", "|---|" + "---|" * len(counts)]
    for task, e in report["tasks"].items():
        lines.append(f"| {task} | " + " | ".join(
            f"{e['accuracy_by_shapes'][str(n)]:.0%} ({e['n_by_shapes'][str(n)]})" if str(n) in e["accuracy_by_shapes"] else "-"
            for n in counts) + " |")
    for task, group, title, label in (
            ("existence", "case", "Existence by what the scene holds of the named shape", lambda case: case.replace("_", " ")),
            ("count", "variant", "Count by what the question names", lambda v: "all shapes" if v == "all" else f"one {v}")):
        e = report["tasks"].get(task, {})
        if f"accuracy_by_{group}" in e:
            lines += ["", f"{title} (questions): " + ", ".join(
                f"{label(key)} {accuracy:.0%} ({e[f'n_by_{group}'][key]})" for key, accuracy in e[f"accuracy_by_{group}"].items())]
    return "\n".join(lines)


def samples_dir() -> str:
    """Folder of the bundled demo images (PNG) and their questions and answers (samples.json)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")


def demo_samples() -> list[dict]:
    """The bundled sample images with their questions and answers, then a freshly generated video
    (ShapesWorld test split, so none of them was seen in training)."""
    from PIL import Image

    from vlmkit.data import make_sample

    with open(os.path.join(samples_dir(), "samples.json")) as handle:
        entries = json.load(handle)
    samples = []
    for entry in entries:
        with Image.open(os.path.join(samples_dir(), entry["file"])) as image:
            samples.append({**entry, "image": image.convert("RGB"), "video": None, "fps": None})
    return samples + [make_sample(DEMO_SEEDS["motion"], task="motion", split="test")]


def write_demo_samples() -> None:
    """Regenerate vlmkit/samples/ from DEMO_SEEDS (run once when the demo questions change)."""
    from vlmkit.data import make_sample

    os.makedirs(samples_dir(), exist_ok=True)
    entries = []
    for task, seed in DEMO_SEEDS.items():
        if task == "motion":
            continue  # the video is generated at run time
        sample = make_sample(seed, task=task, split="test")
        sample["image"].save(os.path.join(samples_dir(), f"{task}.png"), optimize=True)
        entries.append({"file": f"{task}.png", "task": task, "question": sample["question"],
                        "answer": sample["answer"], "image_size": list(sample["image"].size)})
    with open(os.path.join(samples_dir(), "samples.json"), "w") as handle:
        json.dump(entries, handle, indent=1)


def demo(model_path: str | None) -> None:
    """pipeline("image-text-to-text") on the bundled images and a generated video: question, the
    model's answer, the true one."""
    import torch
    from transformers import pipeline

    from vlmkit.data import as_messages, grade

    start = time.time()
    use_cpu_threads()
    pipe = pipeline("image-text-to-text", model=model_path or default_model_path(), dtype=torch.float32)
    samples, correct = demo_samples(), 0
    for sample in samples:
        kwargs = {"processor_kwargs": {"video_metadata": {"fps": sample["fps"]}}} if sample.get("video") else {}
        out = pipe(text=as_messages(sample, include_answer=False), max_new_tokens=48, return_full_text=False, **kwargs)
        answer = out[0]["generated_text"].strip()
        ok = grade(sample["task"], answer, sample["answer"])
        correct += ok
        media = (f"video, {len(sample['video'])} frames" if sample.get("video")
                 else "image {}x{}".format(*sample["image_size"]))
        print(f"[{'ok ' if ok else 'MISS'}] {sample['task']:<9} ({media}) Q: {sample['question']}\n"
              f"       model: {answer}\n       truth: {sample['answer']}")
    print(f"{correct}/{len(samples)} correct in {time.time() - start:.1f} s")


def chat(model_path: str | None, image: str | None, video: str | None, question: str | None, fps: float) -> None:
    model, processor = load(model_path)

    def ask(text: str) -> str:
        content = []
        if video:
            content.append({"type": "video", "video": video})
        elif image:
            content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": text})
        inputs = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True, return_tensors="pt",
                                               processor_kwargs={"video_metadata": {"fps": fps}} if video else None)
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
        return processor.post_process_image_text_to_text(out[:, inputs["input_ids"].shape[1]:])[0].strip()

    if question:
        print(ask(question))
        return
    print("Ask about the image (empty line or Ctrl-D to quit).")
    for line in sys.stdin:
        if not line.strip():
            break
        print(ask(line.strip()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vlmkit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the bundled ShapesWorld model)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="answer questions about bundled sample images and a video")
    chat_parser = commands.add_parser("chat", help="ask about an image or a video")
    chat_parser.add_argument("--image")
    chat_parser.add_argument("--video")
    chat_parser.add_argument("--fps", type=float, default=2.0, help="frame rate of --video given as frames")
    chat_parser.add_argument("question", nargs="?")
    eval_parser = commands.add_parser("eval", help="per-task accuracy with baselines")
    eval_parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
    eval_parser.add_argument("--num", type=int, default=700)
    eval_parser.add_argument("--seed", type=int, default=0)
    eval_parser.add_argument("--json", action="store_true")
    eval_parser.add_argument("--novelty-reference", type=int, default=20000,
                             help="training captions to compare generated captions with")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "demo":
        demo(args.model)
    elif args.command == "chat":
        if not (args.image or args.video):
            parser.error("chat needs --image or --video")
        chat(args.model, args.image, args.video, args.question, args.fps)
    else:
        model, processor = load(args.model)
        report = evaluate(model, processor, args.split, args.num, args.seed, progress=not args.json,
                          novelty_reference=args.novelty_reference)
        print(json.dumps(report, indent=2) if args.json else format_report(report))


if __name__ == "__main__":
    main()

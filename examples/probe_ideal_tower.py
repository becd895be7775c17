"""Is the language model or the vision tower what keeps the shipped model from reading multi-shape scenes?

    python examples/probe_ideal_tower.py --json ideal.json                       # an ideal tower
    python examples/probe_ideal_tower.py --group 8 --json ideal_group8.json      # existence as minimal pairs
    python examples/probe_ideal_tower.py --tower stage1 --json stage1.json       # train_shapes.py's stage 1, frozen
    python examples/probe_ideal_tower.py --question-first --json ideal_qf.json   # the question before the image

Trains a fresh copy of the shipped model's language model on colour, existence and count questions
about images of 1-5 shapes, and prints every --eval-every steps the exact-match rate on validation
scenes of one, three and five shapes.

The visual tokens come from one of two towers, both frozen:
- `ideal` reads them off the scene description. Every 32 px cell gets what `train_shapes.py`'s
  stage 1 teaches the real tower to output: the language model's embeddings of its shape's colour and
  kind added (" red" + " star"; the same labels as `vlmkit.data.shapes.cell_labels`), or a learned
  background vector, plus a learned vector where a shape's centre falls (stage 1's third label, which
  tells one shape over several cells from several shapes). No pixel is looked at. The embeddings are the language model's live ones, so
  the tokens move with them.
- `stage1` runs stage 1 of `train_shapes.py` (--vision-steps, dense name-scored labels), then freezes
  the tower and its merger.

If the language model learns a task over ideal tokens in a few hundred steps but not over the trained
tower's, the tower is what to fix, and the other way round.

`--features count,layout` adds to the ideal tokens what a structured tower could also be taught to
put there (`vlmkit.data.shapes.cell_attributes`), each through a learned table or linear map: `count`
the scene's shape count on every cell and, on a shape's cells, how many shapes share its colour and
its kind (0 on background); `layout` the cell's place in the image (a linear map), the digits of
the shape's relative box (a table per digit place), its size and left-to-right rank, and the
background type. `--tasks` trains other ShapesWorld image tasks too
(position, grounding, caption); grounding is scored as the mean IoU of greedily generated boxes.

    python examples/probe_ideal_tower.py --group 8 --features count --json ideal_count.json
    python examples/probe_ideal_tower.py --group 8 --features count,layout \
        --tasks colour,existence,count,position,grounding,caption --json ideal_all.json

`--tasks centre` trains and scores centre questions (`vlmkit.data.centre_questions`: one shape's
place relative to the image's centre, a precursor of position), and `--then STEP:TASKS` switches the
tasks trained at a step (all of both are scored throughout). The curriculum that made position
learnable, over the `place` feature (each shape cell's offset from the image's centre):

    python examples/probe_ideal_tower.py --features place --tasks centre --then 500:centre,position \
        --position-group 8 --steps 2000 --json centre_then_position.json

train_shapes.py's other precursors are tasks here too: `kind` ("What shape is the red one?") finds
a shape by its colour, as counting "the red shapes" must.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_shapes  # noqa: E402  (the example next to this one: tokenizer, model, stage 1, scoring)

from vlmkit.cli import COUNT_VARIANTS, answer_samples  # noqa: E402
from vlmkit.data import (  # noqa: E402
    BACKGROUNDS, COLOURS, KINDS, as_messages, count_questions, existence_questions, make_sample, position_questions,
)
from vlmkit.data.shapesworld import TEMPLATES  # noqa: E402
from vlmkit.data.shapes import SIZES, cell_attributes, cell_labels, iou, parse_box  # noqa: E402
from vlmkit.modeling.modeling_vlmkit import VLMKitVisualOutput  # noqa: E402
from vlmkit.training import VLMKitDataCollator, per_sample_loss  # noqa: E402

TASKS = train_shapes.OPENING_TASKS  # train_shapes.py --opening-steps trains these, as this probe does
SHAPE_COUNTS = (1, 3, 5)  # a position question needs two shapes: its "1" is scored on two-shape scenes
# --tasks also takes train_shapes.py's precursors, which are not eval tasks: "centre", position
# relative to the image's centre (`centre_questions`), which may teach the language model to find one
# shape and read its place; "kind" ("What shape is the red one?"), which finds a shape by its colour
CENTRE = train_shapes.CENTRE
PRECURSORS = train_shapes.PRECURSORS
# --features takes cell_attributes' names, or a group of them: the groups of train_shapes.py's
# --structured-heads, so a probe's features are what a structured stage 1 would teach
FEATURE_GROUPS = {group: train_shapes.STRUCTURED_GROUPS[group] for group in ("count", "layout")}
FEATURES = tuple(name for names in FEATURE_GROUPS.values() for name in names)


def expand_features(names: tuple[str, ...]) -> tuple[str, ...]:
    """("count", "where") -> ("total", "colour_count", "kind_count", "where"); unknown names raise."""
    unknown = sorted(set(names) - set(FEATURES) - set(FEATURE_GROUPS))
    if unknown:
        raise ValueError(f"unknown feature(s) {unknown}; choose from {', '.join((*FEATURE_GROUPS, *FEATURES))}")
    return tuple(dict.fromkeys(f for name in names for f in FEATURE_GROUPS.get(name, (name,))))
MAX_SHAPES = train_shapes.MAX_SHAPES  # the count and rank tables cover scenes of up to this many shapes


class SlotTables(torch.nn.Module):
    """One learned table per slot, summed: (N, slots) ints in 0..values-1 -> (N, width). The box's
    digits, say: the digit in x1's hundreds place and the one in its tens place get different rows.
    Rows start at scale / sqrt(slots), so that their sum has the norm of one `scale` row."""

    def __init__(self, slots: int, values: int, width: int, scale: float):
        super().__init__()
        self.values = values
        self.rows = torch.nn.Embedding(slots * values, width)
        torch.nn.init.normal_(self.rows.weight, std=scale / slots ** 0.5)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(index.shape[-1]) * self.values  # (slots,)
        return self.rows(index + offsets).sum(-2)


class IdealTower(torch.nn.Module):
    """Stands in for model.model.visual: per image, one token per 32 px cell, embed(colour) +
    embed(kind) of the shape the cell shows, or a learned background vector; plus a learned centre
    vector in the cells where a shape's centre falls. The scenes of the images in the next forward
    are queued in `scenes` (the pixels are ignored)."""

    def __init__(self, embed: torch.nn.Embedding, tokenizer, cell: int = 32, features: tuple[str, ...] = (),
                 feature_scale: float = 1.0):
        super().__init__()
        self.embed, self.cell, self.scenes, self.features = embed, cell, [], expand_features(tuple(features))
        self.kind_ids = torch.tensor([ids[0] for ids in train_shapes.name_token_ids(tokenizer, KINDS)])
        self.colour_ids = torch.tensor([ids[0] for ids in train_shapes.name_token_ids(tokenizer, COLOURS)])
        width, scale = embed.embedding_dim, embed.weight.std().item()
        self.background = torch.nn.Parameter(torch.randn(width) * scale)
        self.centre = torch.nn.Parameter(torch.randn(width) * scale)
        scale *= feature_scale  # the extras' rows start at feature_scale times a word row's norm

        def table(rows: int) -> torch.nn.Embedding:
            rows_ = torch.nn.Embedding(rows, width)
            torch.nn.init.normal_(rows_.weight, std=scale)
            return rows_

        def place_map(std: float = scale) -> torch.nn.Linear:
            # at the scale of a word row too: nn.Linear's own init (fan-in 2) gave a vector 15-18 times a
            # name's norm, which buried the names and kept every --features run with it at chance
            linear = torch.nn.Linear(2, width, bias=False)
            torch.nn.init.normal_(linear.weight, std=std)
            return linear

        # the structured tower's extras, by cell_attributes' names: learned tables (classes) or maps (floats)
        makers = dict(total=lambda: table(MAX_SHAPES + 1), colour_count=lambda: table(MAX_SHAPES + 1),
                      kind_count=lambda: table(MAX_SHAPES + 1), size=lambda: table(len(SIZES) + 1),
                      rank=lambda: table(MAX_SHAPES + 1), background_type=lambda: table(len(BACKGROUNDS)),
                      where=place_map, place=lambda: place_map(2 * scale),  # place's values are half where's
                      box_digits=lambda: SlotTables(train_shapes.BOX_PLACES, train_shapes.BOX_VALUES, width, scale))
        self.extras = torch.nn.ModuleDict({name: makers[name]() for name in self.features})

    def feature_norms(self) -> dict[str, float]:
        """Each learned table's mean row norm over the mean norm of the colour and kind words' rows: about
        --feature-scale at the start, then how far training has grown a feature against the names."""
        words = self.embed.weight[torch.cat([self.colour_ids, self.kind_ids])].norm(dim=-1).mean()
        return {f"norm_{name}": round((module.weight.norm(dim=-1).mean() / words).item(), 2)
                for name, module in self.extras.items() if isinstance(module, torch.nn.Embedding)}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> VLMKitVisualOutput:
        if len(self.scenes) != len(grid_thw):
            raise ValueError(f"{len(grid_thw)} images in the batch but {len(self.scenes)} scenes queued")
        tokens = []
        for scene in self.scenes:
            labels = cell_labels(scene, cell=self.cell)
            kind = torch.from_numpy(labels["kind"]).flatten()  # (rows*cols,), row-major like the merged tokens
            colour = torch.from_numpy(labels["colour"]).flatten()
            on_shape = kind < len(KINDS)
            cells = self.background.expand(len(kind), -1).clone()
            cells[on_shape] = self.embed(self.kind_ids[kind[on_shape]]) + self.embed(self.colour_ids[colour[on_shape]])
            cells = cells + torch.from_numpy(labels["centre"]).flatten()[:, None] * self.centre
            if len(self.extras):
                attributes = cell_attributes(scene, cell=self.cell)
                for name, module in self.extras.items():
                    value = torch.from_numpy(attributes[name])
                    value = value.flatten(0, 1) if value.ndim == 3 else value.flatten()  # (rows*cols[, k])
                    value = value if value.dtype == torch.int64 else value.float()
                    cells = cells + module(value).to(cells.dtype)
            tokens.append(cells)
        self.scenes = []
        return VLMKitVisualOutput(last_hidden_state=None, pooler_output=torch.cat(tokens), deepstack_features=None)


def one_template(sample: dict, template: int) -> dict:
    """A position sample asked in TEMPLATES["position"][template] (others unchanged). The templates
    name the two shapes in either order ("Relative to the {b}, where is the {a}?"), so which one the
    answer is about depends on the phrasing: asking one way only takes that parsing out."""
    if sample["task"] not in ("position", CENTRE):
        return sample
    a, b = (named if isinstance(named := sample["query"][k], str) else f"{named['colour']} {named['kind']}"
            for k in ("a", "b"))  # b is a string for centre questions
    return dict(sample, template=template, question=TEMPLATES["position"][template].format(a=a, b=b))


def training_samples(step: int, batch_size: int, group: int, shapes: tuple[int, int],
                     tasks: tuple[str, ...] = TASKS, position_group: int = 1, count_group: int = 1) -> list[dict]:
    """A batch of fresh samples, the tasks in turn. With `group` > 1, consecutive existence slots
    take the `group` minimal-pair questions about one scene (`existence_questions`) one after the
    other, so they share the batch and the task mix stays the same; `position_group` does the same
    for position (`position_questions`: each pair of shapes asked both ways) and `count_group` for count
    (`count_questions`)."""
    options = dict(difficulty=2, min_shapes=shapes[0], max_shapes=shapes[1])
    # task -> (questions per group, draw(seed, count) -> that many questions); centre's four each ask
    # about another shape (of one scene while it has enough)
    grouped = {"existence": (group, lambda seed, count: existence_questions(
                   make_sample(seed, task="existence", **options), seed, count)),
               "position": (position_group, lambda seed, count: position_questions(
                   make_sample(seed, task="position", **options), seed, count)),
               "count": (count_group, lambda seed, count: count_questions(
                   make_sample(seed, task="count", **options), seed, count)),
               CENTRE: (4, lambda seed, count: train_shapes.centre_samples(seed, count, **options))}
    samples, pending = [], {task: [] for task in grouped}
    for index in range(batch_size):
        seed = 1_000_003 * (step + 1) + index
        task = tasks[index % len(tasks)]
        size, draw = grouped.get(task, (1, None))
        if size > 1:
            if not pending[task]:
                pending[task] = draw(seed, size)
            samples.append(pending[task].pop(0))
            continue
        samples.append(train_shapes.precursor_samples(task, seed, 1, **options)[0] if task in PRECURSORS
                       else make_sample(seed, task=task, **options))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower", default="ideal", choices=["ideal", "stage1"])
    parser.add_argument("--vision-steps", type=int, default=4000, help="stage 1 steps for --tower stage1")
    parser.add_argument("--stage1-cache", help="--tower stage1: load the stage-1 model from this file if it exists, "
                                               "else save it there (stage 1 takes 17 minutes)")
    parser.add_argument("--group", type=int, default=1, help="existence questions per scene, side by side (1 or even)")
    parser.add_argument("--position-template", type=int, choices=range(len(TEMPLATES["position"])),
                        help="ask every position question (training and validation) in this one phrasing")
    parser.add_argument("--position-group", type=int, default=1,
                        help="position questions per scene, side by side, each pair of shapes asked both ways (1 or even)")
    parser.add_argument("--count-group", type=int, default=1,
                        help="count questions per scene, side by side, naming different colours and kinds")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--per-count", type=int, default=48, help="validation questions per task and shape count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--question-first", action="store_true",
                        help="the question before the image in the user turn, so the visual tokens can attend to it")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated image tasks (or precursors: {', '.join(PRECURSORS)}) to train and score, in turn")
    parser.add_argument("--then", default="", metavar="STEP:TASKS",
                        help="from step STEP on, train these comma-separated tasks instead (a curriculum: "
                             "centre questions first, say, then position); all are scored throughout")
    parser.add_argument("--features", default="", help=f"--tower ideal: comma-separated extras, groups ({', '.join(FEATURE_GROUPS)}) "
                        f"or single cell_attributes ({', '.join(FEATURES)})")
    parser.add_argument("--word-tokenizer", action="store_true",
                        help="train_shapes.py --word-tokenizer's vocabulary (role names and answer words one token each)")
    parser.add_argument("--feature-scale", type=float, default=1.0,
                        help="--features: start the extras at this many times a word row's norm")
    parser.add_argument("--frozen-features", action="store_true",
                        help="--features: keep the extras' tables and maps at their random start, as a frozen tower's "
                             "outputs are, rather than training them with the language model")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, a few steps (the test)")
    parser.add_argument("--json", help="also write the curve here")
    args = parser.parse_args()
    tasks, features = tuple(args.tasks.split(",")), expand_features(tuple(f for f in args.features.split(",") if f))
    switch_step, later_tasks = (int(args.then.split(":")[0]), tuple(args.then.split(":")[1].split(","))) if args.then else (0, ())
    scored = tuple(dict.fromkeys((*tasks, *later_tasks)))
    if "motion" in scored or not set(scored) <= {*train_shapes.IMAGE_TASKS, *PRECURSORS}:
        raise ValueError(f"--tasks and --then take image tasks ({', '.join(train_shapes.IMAGE_TASKS)}) and precursors "
                         f"({', '.join(PRECURSORS)}), got {', '.join(scored)}")
    if features and args.tower != "ideal":
        raise ValueError("--features adds to the ideal tower's tokens: use it with --tower ideal")
    if not features and (args.feature_scale != 1.0 or args.frozen_features):
        raise ValueError("--feature-scale and --frozen-features set the --features extras: name some with --features")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tokenizer = train_shapes.shapes_tokenizer(args.smoke, args.word_tokenizer)
    model, processor = train_shapes.build_model_and_processor(tokenizer, args.smoke)
    model.config.use_cache = False
    vision_curve = []
    if args.tower == "ideal":
        model.model.visual = IdealTower(model.get_input_embeddings(), tokenizer, features=features,
                                        feature_scale=args.feature_scale)
        model.model.visual.extras.requires_grad_(not args.frozen_features)
    elif args.stage1_cache and os.path.exists(args.stage1_cache):
        cached = torch.load(args.stage1_cache)
        model.load_state_dict(cached["model"])
        vision_curve = cached["vision_curve"]
        if vision_curve[-1]["step"] != args.vision_steps:
            raise ValueError(f"{args.stage1_cache} holds {vision_curve[-1]['step']} stage-1 steps, not --vision-steps "
                             f"{args.vision_steps}")
    else:
        vision_curve, _ = train_shapes.pretrain_vision(model, processor, args.vision_steps, args.batch_size, lr=5e-4,
                                                       seed=0, eval_every=max(1, args.vision_steps // 4))
        if args.stage1_cache:
            torch.save({"model": model.state_dict(), "vision_curve": vision_curve}, args.stage1_cache)
    if args.tower == "stage1":
        # the tower and its merger stay as stage 1 left them; the DeepStack mergers, which stage 1 never
        # trains, learn with the language model rather than add fixed random features to its first layers
        for name, param in model.model.visual.named_parameters():
            param.requires_grad_("deepstack_merger_list" in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    collator = VLMKitDataCollator(processor)

    def batch_of(samples: list[dict]) -> dict:
        if args.position_template is not None:
            samples = [one_template(s, args.position_template) for s in samples]
        if isinstance(model.model.visual, IdealTower):
            model.model.visual.scenes = [s["scene"] for s in samples]
        return collator([{"messages": as_messages(s, question_first=args.question_first), "fps": s["fps"]}
                          for s in samples])

    def validation_samples(task: str, n: int) -> list[dict]:
        if task in PRECURSORS:
            return [train_shapes.precursor_samples(task, i, 1, split="validation", difficulty=2, min_shapes=n,
                                                   max_shapes=n)[0] for i in range(args.per_count)]
        return [make_sample(i, task=task, split="validation", difficulty=2, min_shapes=n, max_shapes=n)
                for i in range(args.per_count)]

    validation = {(task, n): validation_samples(task, n) for task in scored for n in SHAPE_COUNTS}

    def greedy_answers(samples: list[dict]) -> list[str]:
        texts = []
        for i in range(0, len(samples), 16):
            if isinstance(model.model.visual, IdealTower):
                model.model.visual.scenes = [s["scene"] for s in samples[i:i + 16]]
            texts += answer_samples(model, processor, samples[i:i + 16], max_new_tokens=24)
        return texts

    def evaluate() -> dict[str, float]:
        # the scenes must be queued batch by batch, so exact_match's own collation is not used
        row, was_training = {}, model.training
        model.eval()
        with torch.no_grad():
            for (task, count), samples in validation.items():
                if task == "grounding":  # greedy boxes: teacher forcing credits a model that copies its input
                    scores = [iou(parse_box(text), parse_box(s["answer"]))
                              for text, s in zip(greedy_answers(samples), samples)]
                    row[f"{task}/{count}"] = round(sum(scores) / len(scores), 3)
                    continue
                batch = batch_of(samples)
                labels = batch.pop("labels")
                predicted, targets = model(**batch).logits[:, :-1].argmax(-1), labels[:, 1:]
                hits = ((predicted == targets) | (targets == train_shapes.IGNORE_INDEX)).all(dim=1)
                row[f"{task}/{count}"] = round(hits.float().mean().item(), 3)
                if task == "count":  # "How many shapes?" apart from those that name a colour or a kind
                    for variant in COUNT_VARIANTS:
                        chosen = torch.tensor([s["query"]["variant"] == variant for s in samples])
                        if chosen.any():
                            row[f"count_{variant}/{count}"] = round(hits[chosen].float().mean().item(), 3)
        model.train(was_training)
        if isinstance(model.model.visual, IdealTower):
            row.update(model.model.visual.feature_norms())
        return row

    curve, start = [], time.time()
    model.train()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, step / 100)  # linear warm-up, then constant: a probe, not a recipe
        now = later_tasks if later_tasks and step >= switch_step else tasks
        batch = batch_of(training_samples(step, args.batch_size, args.group, (1, 2 if args.smoke else 5), now,
                                          args.position_group, args.count_group))
        labels = batch.pop("labels")
        loss = per_sample_loss(model(**batch), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            row = {"step": step, "minutes": round((time.time() - start) / 60, 2), "loss": round(loss.item(), 4),
                   **evaluate()}
            curve.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tower": args.tower, "vision_steps": args.vision_steps if args.tower == "stage1" else 0,
                       "group": args.group, "position_group": args.position_group, "count_group": args.count_group, "position_template": args.position_template, "question_first": args.question_first, "steps": args.steps,
                       "batch_size": args.batch_size, "lr": args.lr, "tasks": list(tasks), "then": args.then, "features": list(features),
                       "feature_scale": args.feature_scale, "frozen_features": args.frozen_features,
                       "word_tokenizer": args.word_tokenizer,
                       "vision_curve": vision_curve, "curve": curve}, handle, indent=1)


if __name__ == "__main__":
    main()

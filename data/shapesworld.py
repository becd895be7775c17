"""ShapesWorld: a procedural vision-language task generator, deterministic by seed.

A sample is one question about a freshly drawn scene of 1-5 flat shapes (or a 4-8 frame clip of one
shape moving), with a short, exactly gradable answer:

==========  ==========================================  =============================================
task        example question                            answers
==========  ==========================================  =============================================
caption     "Describe the image."                       "a small red circle, a large blue star and a
                                                        small green square on a striped background."
                                                        (shapes left to right; plain / striped /
                                                        checkered / speckled background)
count       "How many shapes are there?"                digits: "1".."5" for all shapes, "0".."3" for
            "How many circles are there?"               the shapes of one kind or one colour
            "How many red shapes are there?"
colour      "What colour is the star?"                  a colour name (`COLOURS`); the kind asked
                                                        about occurs exactly once
existence   "Is there a blue square?"                   "yes" / "no", 50/50; a "no" scene holds the
                                                        colour on another kind and the kind in another
                                                        colour (one of them for a single shape)
position    "Where is the red circle relative to the    "left" / "right" / "above" / "below" (of the
            green star?"                                first shape relative to the second; asked only
                                                        when exactly one holds clearly)
grounding   "Where is the blue triangle? Give its box."  "[x1, y1, x2, y2]": Qwen3-VL relative integers
                                                        0..1000, x * 1000 / width, y * 1000 / height
motion      "Which way does the red circle move?"       "left" / "right" / "up" / "down"
==========  ==========================================  =============================================

Scenes: 1-5 shapes (`KINDS`: circle, square, triangle, star, diamond, hexagon, cross; `COLOURS`: red,
orange, yellow, green, blue, purple, black; small or large), never overlapping, on a light plain,
striped, checkered or speckled background. Images are 96-192 px a side in steps of 32 (patch 16 x
merge 2, so the processor need not resize), aspect ratio up to 2:1; see `DEFAULTS` for every option
(image_size, max_shapes, backgrounds, num_frames, fps, tasks, weights, ...) and `CURRICULUM` for
easier presets (`difficulty=0/1/2`).

Every shape named in a question is unique in its scene by colour and kind. Seeds: `make_sample(seed,
task, split, heldout)` draws from numpy's SeedSequence over (seed, split, heldout, task), so one int
regenerates a sample anywhere and the splits never share a seed stream; `build_dataset` gives sample i
of a split the seed `sample_seed(seed, i)` and also drops any validation or test sample whose image
hash occurs in an earlier split. Held-out colour-shape pairs (`HELDOUT_COMBOS`) never appear in train
or validation images or questions; the test split's held-out part (`heldout=True`) asks about one.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .shapes import (
    BACKGROUNDS, COLOURS, DIRECTIONS, HELDOUT_COMBOS, KINDS, PLURALS, SEEN_COMBOS, SIZES, blank_image, box_to_relative, centre,
    content_hash, encode_png, format_box, iou, parse_box, place_box, random_box, relation, relative_box,
    relative_to_box, render_scene, render_video, sample_background, sample_image_size, shape_side,
)

TASKS: tuple[str, ...] = ("caption", "count", "colour", "existence", "position", "grounding", "motion")
SPLITS: tuple[str, ...] = ("train", "validation", "test")
_SPLIT_CODES = {"train": 0, "validation": 1, "test": 2}
RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
BACKGROUND_WORDS = {"plain": "plain", "striped": "striped", "checkered": "checkered", "speckled": "speckled"}
# The answers each task can give (grounding: a box string, caption: a sentence).
ANSWER_SETS: dict[str, tuple[str, ...] | None] = {
    "caption": None,
    "count": tuple(str(n) for n in range(9)),
    "colour": tuple(COLOURS),
    "existence": ("yes", "no"),
    "position": RELATIONS,
    "grounding": None,
    "motion": DIRECTIONS,
}

TEMPLATES: dict[str, tuple[str, ...]] = {
    "caption": ("Describe the image.", "What is in this picture?", "Caption this image.",
                "Describe the shapes from left to right.", "Write a short caption for the image."),
    "count_all": ("How many shapes are there?", "How many shapes are in the image?", "Count the shapes.",
                  "How many objects can you see?", "What is the number of shapes in the picture?"),
    "count_kind": ("How many {kinds} are there?", "Count the {kinds}.", "How many {kinds} can you see?",
                   "What is the number of {kinds} in the image?"),
    "count_colour": ("How many {colour} shapes are there?", "Count the {colour} shapes.",
                     "How many shapes are {colour}?", "How many {colour} objects can you see?"),
    "colour": ("What colour is the {kind}?", "What color is the {kind}?", "Which colour is the {kind}?",
               "Name the colour of the {kind}.", "The {kind} is what colour?"),
    "existence": ("Is there {a_obj}?", "Is there {a_obj} in the image?", "Can you see {a_obj}?",
                  "Does the picture contain {a_obj}?", "Is {a_obj} present?"),
    "position": ("Where is the {a} relative to the {b}?", "Is the {a} left of, right of, above or below the {b}?",
                 "Relative to the {b}, where is the {a}?",
                 "Where is the {a} compared with the {b}? Answer left, right, above or below.",
                 "In relation to the {b}, where is the {a}?"),
    "grounding": ("Where is the {obj}? Give its box.", "Give the bounding box of the {obj}.",
                  "Locate the {obj} as [x1, y1, x2, y2].", "Output the box of the {obj}.",
                  "Find the {obj} and give its coordinates."),
    "motion": ("Which way does the {obj} move?", "In which direction is the {obj} moving?",
               "Where does the {obj} go: left, right, up or down?", "Which direction does the {obj} travel?",
               "How does the {obj} move?"),
}

DEFAULTS: dict = dict(
    image_size=(96, 192),  # int: fixed square; (lo, hi): each side drawn from multiples of size_multiple
    size_multiple=32,  # 32 = patch 16 x merge 2: the processor then needs no resize
    max_aspect=2.0,
    min_shapes=1,
    max_shapes=5,  # position asks about 2 shapes, so it uses at least 2
    backgrounds=BACKGROUNDS,
    num_frames=(4, 8),  # int or (lo, hi) inclusive
    fps=2.0,
    distractor_prob=0.5,  # motion: chance of one static distractor shape
    tasks=None,  # restricts the task drawn when make_sample's task is None
    weights=None,  # {task: weight} for that draw; uniform when None
)
# Curriculum presets, easiest first: `difficulty=i` starts from CURRICULUM[i] (explicit options win).
CURRICULUM: tuple[dict, ...] = (
    dict(image_size=128, max_shapes=2, backgrounds=("plain",), num_frames=4, distractor_prob=0.0),
    dict(image_size=(96, 160), max_shapes=3, backgrounds=("plain", "striped"), num_frames=(4, 6)),
    dict(),
)


def _position_margin(width: int, height: int) -> int:
    """How far apart (px) two shapes must be along one axis for a position question about them."""
    return max(4, round(0.05 * min(width, height)))


class _Retry(Exception):
    """The scene could not be laid out; draw again (from the same generator, so still deterministic)."""


class _Context:
    def __init__(self, rng: np.random.Generator, heldout: bool, opts: dict):
        self.rng, self.heldout, self.opts = rng, heldout, opts
        self.width, self.height = sample_image_size(rng, opts["image_size"], opts["size_multiple"],
                                                    opts["max_aspect"])
        short = min(self.width, self.height)
        self.gap, self.margin = max(3, round(0.03 * short)), 2
        self.position_margin = _position_margin(self.width, self.height)
        self.lo, self.hi = opts["min_shapes"], opts["max_shapes"]

    def n_shapes(self, at_least: int = 1) -> int:
        lo, hi = max(self.lo, at_least), max(self.hi, at_least)
        return int(self.rng.integers(lo, hi + 1))

    def pick(self, held: bool = False, kind=None, colour=None, not_kinds=(), not_colours=(), not_combos=()):
        pool = HELDOUT_COMBOS if held else SEEN_COMBOS
        found = [(c, k) for c, k in pool if (kind is None or k == kind) and (colour is None or c == colour)
                 and k not in not_kinds and c not in not_colours and (c, k) not in not_combos]
        if not found:
            raise _Retry
        return found[int(self.rng.integers(len(found)))]

    def focus(self, **constraints):
        """The combo a question is about: held out in a held-out sample, else seen."""
        return self.pick(held=self.heldout, **constraints)

    def size(self) -> str:
        return SIZES[int(self.rng.integers(len(SIZES)))]

    def shape(self, combo, size: str, box) -> dict:
        return {"kind": combo[1], "colour": combo[0], "size": size, "box": [int(v) for v in box],
                "centre": list(centre(box))}

    def place(self, combos: Sequence[tuple[str, str]], placed: Sequence[dict] = ()) -> list[dict]:
        """Lay out shapes clear of each other; a large shape that does not fit becomes small."""
        shapes = list(placed)
        for combo in combos:
            size = self.size()
            for attempt in ((size, "small") if size == "large" else (size,)):
                side = shape_side(self.rng, attempt, self.width, self.height)
                box = place_box(self.rng, side, self.width, self.height, [s["box"] for s in shapes],
                                self.gap, self.margin)
                if box is not None:
                    shapes.append(self.shape(combo, attempt, box))
                    break
            else:
                raise _Retry
        return shapes

    def shuffled(self, shapes: list[dict]) -> list[dict]:
        return [shapes[i] for i in self.rng.permutation(len(shapes))]

    def template(self, key: str) -> tuple[int, str]:
        index = int(self.rng.integers(len(TEMPLATES[key])))
        return index, TEMPLATES[key][index]


def _name(combo) -> str:
    return f"{combo[0]} {combo[1]}"


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


# ------------------------------------------------------------------------------------------ tasks
# Each returns (shapes, query, template index, question, answer); motion also returns its motion dict.


def _caption(ctx: _Context):
    combos = [ctx.pick() for _ in range(ctx.n_shapes())]
    if ctx.heldout:
        combos[0] = ctx.focus()
    shapes = ctx.shuffled(ctx.place(combos))
    index, question = ctx.template("caption")
    return shapes, {}, index, question, None  # the caption needs the background: filled in by make_sample


def caption_of(scene: dict) -> str:
    """The canonical caption: shapes sorted by centre x (then y), joined "a, b and c", then background."""
    shapes = sorted(scene["shapes"], key=lambda s: (s["centre"][0], s["centre"][1]))
    parts = [f"a {s['size']} {s['colour']} {s['kind']}" for s in shapes]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{listed} on a {BACKGROUND_WORDS[scene['background']['type']]} background."


_CAPTION = re.compile(r"(?P<shapes>.+) on an? (?P<background>\S+) background\.?")
_CAPTION_SHAPE = re.compile(r"an? (?P<size>\S+) (?P<colour>\S+) (?P<kind>\S+)")


def parse_caption(text: str) -> tuple[list[tuple[str, str, str] | None], str] | None:
    """A caption in `caption_of`'s form read back: its shapes as (size, colour, kind) from left to
    right (None for a part that is not "a <size> <colour> <kind>") and its background word; None when
    the text is not "... on a <word> background."."""
    match = _CAPTION.fullmatch(normalise_answer(text) + ".")
    if match is None:
        return None
    parts = re.split(r", | and ", match["shapes"])
    shapes = [(m["size"], m["colour"], m["kind"]) if (m := _CAPTION_SHAPE.fullmatch(p)) else None for p in parts]
    return shapes, match["background"]


CAPTION_FIELDS = ("background", "shape_count", "size", "colour", "kind")


def caption_field_hits(prediction: str, answer: str) -> dict[str, list[bool]]:
    """Which of a caption's parts a predicted caption gets right, field by field: its background and
    its number of shapes (one each), and the size, colour and kind of every true shape, compared with
    the predicted shape at the same place in the left-to-right list (a missing one is wrong). A
    prediction not in caption form gets every field wrong."""
    true_shapes, true_background = parse_caption(answer)
    parsed = parse_caption(prediction)
    shapes, background = parsed if parsed else ([], None)
    hits = {"background": [background == true_background], "shape_count": [len(shapes) == len(true_shapes)]}
    for field, i in (("size", 0), ("colour", 1), ("kind", 2)):
        hits[field] = [j < len(shapes) and shapes[j] is not None and shapes[j][i] == true[i]
                       for j, true in enumerate(true_shapes)]
    return hits


def box_errors(prediction: str, answer: str) -> tuple[float, float] | None:
    """How a predicted box misses the true one, in the 0..1000 frame: the distance between their
    centres and the ratio of their sides' geometric means (sqrt of the areas' ratio; 1 is the right
    size). None when the prediction holds no box or an empty one."""
    box, truth = parse_box(prediction), parse_box(answer)
    if box is None or box[2] <= box[0] or box[3] <= box[1]:
        return None
    centre = np.hypot((box[0] + box[2] - truth[0] - truth[2]) / 2, (box[1] + box[3] - truth[1] - truth[3]) / 2)
    scale = np.sqrt((box[2] - box[0]) * (box[3] - box[1]) / ((truth[2] - truth[0]) * (truth[3] - truth[1])))
    return float(centre), float(scale)


def _count(ctx: _Context):
    rng = ctx.rng
    variant = ("all", "kind", "colour")[int(rng.integers(3))]
    if variant == "all":
        combos = [ctx.pick() for _ in range(ctx.n_shapes())]
        if ctx.heldout:
            combos[0] = ctx.focus()
        query = {"variant": "all"}
        fields = {}
    else:
        field = "kind" if variant == "kind" else "colour"
        k = int(rng.integers(0, min(3, ctx.hi) + 1))
        need_other = ctx.heldout and k == 0  # a held-out sample with no matching shape shows one elsewhere
        lo_extra = max(ctx.lo - k, 1 - k, int(need_other), 0)
        if ctx.hi - k < lo_extra:
            raise _Retry
        extra = int(rng.integers(lo_extra, ctx.hi - k + 1))
        if ctx.heldout and k > 0:
            first = ctx.focus()
            value = first[1] if field == "kind" else first[0]
            matching = [first] + [ctx.pick(**{field: value}) for _ in range(k - 1)]
        else:
            values = KINDS if field == "kind" else tuple(COLOURS)
            value = values[int(rng.integers(len(values)))]
            matching = [ctx.pick(**{field: value}) for _ in range(k)]
        exclude = {"not_kinds": (value,)} if field == "kind" else {"not_colours": (value,)}
        others = [ctx.pick(**exclude) for _ in range(extra)]
        if ctx.heldout and k == 0:
            others[0] = ctx.focus(**exclude)
        combos = matching + others
        query = {"variant": variant, field: value}
        fields = {"kinds": PLURALS[value]} if field == "kind" else {"colour": value}
    shapes = ctx.shuffled(ctx.place(combos))
    if variant == "all":
        answer = len(shapes)
    else:
        field = "kind" if variant == "kind" else "colour"
        answer = sum(s[field] == query[field] for s in shapes)
    index, template = ctx.template(f"count_{variant}")
    return shapes, query, index, template.format(**fields), str(answer)


def _colour(ctx: _Context):
    if ctx.heldout:
        target = ctx.focus()
    else:
        colour = tuple(COLOURS)[int(ctx.rng.integers(len(COLOURS)))]
        target = ctx.pick(colour=colour)
    others = [ctx.pick(not_kinds=(target[1],)) for _ in range(ctx.n_shapes() - 1)]
    shapes = ctx.shuffled(ctx.place([target] + others))
    index, template = ctx.template("colour")
    return shapes, {"kind": target[1]}, index, template.format(kind=target[1]), target[0]


def _existence(ctx: _Context):
    n, present = ctx.n_shapes(), bool(ctx.rng.random() < 0.5)
    asked = ctx.focus()
    if present:
        combos = [asked] + [ctx.pick() for _ in range(n - 1)]
    else:  # the asked colour on another kind and the asked kind in another colour, so neither alone answers
        partial = [ctx.pick(colour=asked[0], not_kinds=(asked[1],)), ctx.pick(kind=asked[1], not_colours=(asked[0],))]
        if n == 1:
            partial = [partial[int(ctx.rng.integers(2))]]
        combos = partial + [ctx.pick(not_combos=(asked,)) for _ in range(n - len(partial))]
    shapes = ctx.shuffled(ctx.place(combos))
    index, template = ctx.template("existence")
    query = {"colour": asked[0], "kind": asked[1], "present": present}
    return shapes, query, index, template.format(a_obj=_article(_name(asked))), "yes" if present else "no"


def _position(ctx: _Context):
    rng = ctx.rng
    n = ctx.n_shapes(at_least=2)
    a = ctx.focus()
    b = ctx.pick(not_combos=(a,))
    wanted = RELATIONS[int(rng.integers(len(RELATIONS)))]
    size_a, size_b = ctx.size(), ctx.size()
    side_a = shape_side(rng, size_a, ctx.width, ctx.height)
    side_b = shape_side(rng, size_b, ctx.width, ctx.height)
    for _ in range(30):
        box_a = random_box(rng, side_a, ctx.width, ctx.height, ctx.margin)
        box_b = place_box(rng, side_b, ctx.width, ctx.height, [box_a], ctx.gap, ctx.margin, tries=40,
                          accept=lambda box: relation(box_a, box, ctx.position_margin) == wanted)
        if box_b is not None:
            break
    else:
        raise _Retry
    placed = [ctx.shape(a, size_a, box_a), ctx.shape(b, size_b, box_b)]
    others = [ctx.pick(not_combos=(a, b)) for _ in range(n - 2)]
    shapes = ctx.shuffled(ctx.place(others, placed))
    index, template = ctx.template("position")
    query = {"a": {"colour": a[0], "kind": a[1]}, "b": {"colour": b[0], "kind": b[1]}}
    return shapes, query, index, template.format(a=_name(a), b=_name(b)), wanted


def _grounding(ctx: _Context):
    target = ctx.focus()
    others = [ctx.pick(not_combos=(target,)) for _ in range(ctx.n_shapes() - 1)]
    shapes = ctx.shuffled(ctx.place([target] + others))
    box = next(s["box"] for s in shapes if (s["colour"], s["kind"]) == target)
    index, template = ctx.template("grounding")
    answer = format_box(box_to_relative(box, ctx.width, ctx.height))
    return shapes, {"colour": target[0], "kind": target[1]}, index, template.format(obj=_name(target)), answer


def _motion(ctx: _Context):
    rng, w, h, m = ctx.rng, ctx.width, ctx.height, ctx.margin
    frames = ctx.opts["num_frames"]
    lo, hi = (frames, frames) if isinstance(frames, (int, np.integer)) else frames
    count = int(rng.integers(lo, hi + 1))
    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    target, size = ctx.focus(), ctx.size()
    side = shape_side(rng, size, w, h)
    horizontal = direction in ("left", "right")
    length = w if horizontal else h
    step_lo = max(2, int(np.ceil(0.3 * length / (count - 1))))
    step_hi = (length - 2 * m - side) // (count - 1)
    if step_hi < step_lo:
        raise _Retry
    step = int(rng.integers(step_lo, step_hi + 1))
    travel = step * (count - 1)
    along = int(rng.integers(m, length - m - side - travel + 1))  # the low end of the swept span
    across = int(rng.integers(m, (h if horizontal else w) - m - side + 1))
    sign = 1 if direction in ("right", "down") else -1
    start = along if sign > 0 else along + travel
    boxes = []
    for t in range(count):
        p = start + sign * step * t
        x, y = (p, across) if horizontal else (across, p)
        boxes.append([x, y, x + side, y + side])
    moving = ctx.shape(target, size, boxes[0])
    swept = {"colour": "", "kind": "", "box": [min(b[0] for b in boxes), min(b[1] for b in boxes),
                                                 max(b[2] for b in boxes), max(b[3] for b in boxes)]}
    shapes = [moving]
    if ctx.hi >= 2 and rng.random() < ctx.opts["distractor_prob"]:
        shapes += ctx.place([ctx.pick(not_combos=(target,))], [swept])[1:]
    order = rng.permutation(len(shapes))
    shapes = [shapes[i] for i in order]
    motion = {"target": int(np.flatnonzero(order == 0)[0]), "direction": direction, "step": step,
              "num_frames": count, "boxes": boxes}
    index, template = ctx.template("motion")
    query = {"colour": target[0], "kind": target[1]}
    return shapes, query, index, template.format(obj=_name(target)), direction, motion


_GENERATORS = {"caption": _caption, "count": _count, "colour": _colour, "existence": _existence,
               "position": _position, "grounding": _grounding, "motion": _motion}


# ------------------------------------------------------------------------------------------ API


def _options(options: dict) -> dict:
    difficulty = options.pop("difficulty", None)
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown ShapesWorld option(s): {sorted(unknown)}; known: {sorted(DEFAULTS)} and difficulty")
    opts = dict(DEFAULTS)
    if difficulty is not None:
        opts.update(CURRICULUM[int(difficulty)])
    opts.update(options)
    if not 1 <= opts["min_shapes"] <= opts["max_shapes"] <= 8:
        raise ValueError(f"need 1 <= min_shapes <= max_shapes <= 8, got {opts['min_shapes']}, {opts['max_shapes']}")
    frames = opts["num_frames"]
    lo, hi = (frames, frames) if isinstance(frames, (int, np.integer)) else frames
    if not 2 <= lo <= hi:
        raise ValueError(f"num_frames must be >= 2, got {frames}")
    if not set(opts["backgrounds"]) <= set(BACKGROUNDS) or not opts["backgrounds"]:
        raise ValueError(f"backgrounds must be a non-empty subset of {BACKGROUNDS}")
    return opts


def _task_list(tasks) -> tuple[str, ...]:
    tasks = TASKS if tasks is None else ((tasks,) if isinstance(tasks, str) else tuple(tasks))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown}; choose from {TASKS}")
    return tasks


def _draw_task(seed: int, code: int, heldout: bool, tasks, weights) -> str:
    tasks = _task_list(tasks)
    rng = np.random.default_rng([seed, code, int(heldout), 1000])
    if weights is None:
        return tasks[int(rng.integers(len(tasks)))]
    p = np.array([float(weights.get(t, 0.0)) for t in tasks])
    if p.sum() <= 0 or (p < 0).any():
        raise ValueError(f"weights {weights} give no positive weight to any of {tasks}")
    return tasks[int(rng.choice(len(tasks), p=p / p.sum()))]


def make_sample(seed: int, task: str | None = None, split: str = "train", heldout: bool = False,
                **options) -> dict:
    """One sample, a pure function of (seed, task, split, heldout, options).

    Returns {"task", "image" (PIL or None), "video" (list of PIL frames or None), "fps" (video only),
    "question", "answer", "heldout", "scene" (JSON-able: width, height, background, shapes with pixel
    boxes, motion), "query" (what the question asks about), "template" (phrasing index),
    "image_size" (w, h), "seed", "split", "hash" (sha1 of the pixels)}.
    With task=None the task is drawn from `tasks` / `weights` (options); the draw does not disturb the
    scene, so make_sample(seed, sample["task"], ...) gives the same sample. `heldout=True` (test split
    only) makes the question's shape a held-out colour-shape pair.
    """
    if split not in _SPLIT_CODES:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if heldout and split != "test":
        raise ValueError("held-out colour-shape pairs appear only in the test split")
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    opts = _options(dict(options))
    code, seed = _SPLIT_CODES[split], int(seed)
    task = _draw_task(seed, code, heldout, opts["tasks"], opts["weights"]) if task is None else task
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
    rng = np.random.default_rng([seed, code, int(heldout), TASKS.index(task)])
    for _ in range(100):
        try:
            ctx = _Context(rng, heldout, opts)
            background = sample_background(rng, opts["backgrounds"])
            shapes, query, index, question, answer, *motion = _GENERATORS[task](ctx)
            break
        except _Retry:
            continue
    else:  # pragma: no cover - only with options that leave no room for the shapes
        raise RuntimeError(f"could not lay out a {task} scene with options {opts}")
    scene = {"width": ctx.width, "height": ctx.height, "background": background, "shapes": shapes,
             "motion": motion[0] if motion else None}
    if task == "caption":
        answer = caption_of(scene)
    image, video, fps = None, None, None
    if task == "motion":
        video, fps = render_video(scene), float(opts["fps"])
    else:
        image = render_scene(scene)
    return {"task": task, "image": image, "video": video, "fps": fps, "question": question, "answer": answer,
            "heldout": bool(heldout), "scene": scene, "query": query, "template": index,
            "image_size": (ctx.width, ctx.height), "seed": seed, "split": split,
            "hash": content_hash(video if video is not None else image)}


def sample_seed(base_seed: int, index: int) -> int:
    """The seed of sample `index` of a stream started from `base_seed` (a 63-bit int)."""
    state = np.random.SeedSequence([int(base_seed), int(index)]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) | (int(state[1]) >> 1)


def iter_samples(split: str = "train", seed: int = 0, start: int = 0, heldout: bool = False,
                 **options) -> Iterator[dict]:
    """Endless stream make_sample(sample_seed(seed, i), split=split, ...) for i = start, start+1, ...
    (training draws fresh samples from it; build_dataset's train split is its first num_train)."""
    index = start
    while True:
        yield make_sample(sample_seed(seed, index), split=split, heldout=heldout, **options)
        index += 1


def _png(image) -> dict:
    """An Image feature value: lossless PNG bytes."""
    return {"bytes": encode_png(image), "path": None}


def _row(sample: dict) -> dict:
    image = None if sample["image"] is None else _png(sample["image"])
    video = None if sample["video"] is None else [_png(frame) for frame in sample["video"]]
    return {"task": sample["task"], "image": image, "video": video, "fps": sample["fps"],
            "question": sample["question"], "answer": sample["answer"], "heldout": sample["heldout"],
            "width": sample["image_size"][0], "height": sample["image_size"][1], "seed": sample["seed"],
            "split": sample["split"], "hash": sample["hash"], "template": sample["template"],
            "scene": json.dumps(sample["scene"], separators=(",", ":")),
            "query": json.dumps(sample["query"], separators=(",", ":"))}


def _features():
    from datasets import Features, Image, List, Value

    return Features({
        "task": Value("string"), "image": Image(), "video": List(Image()), "fps": Value("float32"),
        "question": Value("string"), "answer": Value("string"), "heldout": Value("bool"),
        "width": Value("int32"), "height": Value("int32"), "seed": Value("int64"), "split": Value("string"),
        "hash": Value("string"), "template": Value("int32"), "scene": Value("string"), "query": Value("string"),
    })


def generate_split(split: str, count: int, seed: int = 0, tasks=None, heldout: bool = False,
                   exclude_hashes: Iterable[str] = (), weights=None, **options) -> list[dict]:
    """`count` samples of one split: with weights=None the tasks cycle through `tasks` (exactly balanced),
    else each is drawn by weight. Samples whose hash is in exclude_hashes (or repeats one already
    drawn here) are skipped and the stream continues past them."""
    tasks = _task_list(tasks)
    exclude, samples, index = set(exclude_hashes), [], 0
    while len(samples) < count:
        task = tasks[len(samples) % len(tasks)] if weights is None else None
        sample = make_sample(sample_seed(seed, index), task, split, heldout, tasks=tasks, weights=weights, **options)
        index += 1
        if sample["hash"] not in exclude:
            exclude.add(sample["hash"])
            samples.append(sample)
    return samples


def build_dataset(num_train: int, num_validation: int, num_test: int, seed: int = 0, tasks=None,
                  num_test_heldout: int | None = None, weights=None, **options):
    """A datasets.DatasetDict with train / validation / test splits.

    The test split holds num_test samples: num_test - num_test_heldout on seen colour-shape pairs,
    then num_test_heldout (default num_test // 3) on held-out pairs (column heldout=True). Columns:
    task, image (Image, None for videos), video (list of Image, None for images), fps, question, answer,
    heldout, width, height, seed, split, hash, template, scene (JSON), query (JSON). Validation skips any
    image whose hash is in train, test any in train or validation.
    """
    from datasets import Dataset, DatasetDict

    num_test_heldout = num_test // 3 if num_test_heldout is None else num_test_heldout
    if not 0 <= num_test_heldout <= num_test:
        raise ValueError(f"num_test_heldout must be in 0..num_test, got {num_test_heldout}")
    common = dict(seed=seed, tasks=tasks, weights=weights, **options)
    train = generate_split("train", num_train, **common)
    seen = {s["hash"] for s in train}
    validation = generate_split("validation", num_validation, exclude_hashes=seen, **common)
    seen |= {s["hash"] for s in validation}
    test = generate_split("test", num_test - num_test_heldout, exclude_hashes=seen, **common)
    test += generate_split("test", num_test_heldout, heldout=True, exclude_hashes=seen, **common)
    features = _features()

    def to_dataset(samples):
        rows = [_row(s) for s in samples]
        return Dataset.from_dict({key: [r[key] for r in rows] for key in features}, features=features)

    return DatasetDict(train=to_dataset(train), validation=to_dataset(validation), test=to_dataset(test))


def as_messages(sample: dict, include_answer: bool = True, followups: Sequence[dict] = (),
                question_first: bool = False) -> list[dict]:
    """Hugging Face multimodal chat messages for a sample (or a dataset row): the user turn holds the image
    (or the video's frames) then the question (`question_first`: the question, then the image); the
    assistant turn the answer (left out when include_answer=False, for generation). The video's fps is
    sample["fps"]. `followups` (samples about the same image, `scene_questions`) continue the
    conversation, a user and an assistant turn each."""
    content: list[dict] = []
    if sample.get("video"):
        content.append({"type": "video", "video": list(sample["video"])})
    elif sample.get("image") is not None:
        content.append({"type": "image", "image": sample["image"]})
    question = {"type": "text", "text": sample["question"]}
    content = [question, *content] if question_first else [*content, question]
    return _chat(content, sample["answer"] if include_answer else None, followups)


def _chat(user_content: list[dict], answer: str | None, followups: Sequence[dict] = ()) -> list[dict]:
    """A user turn, then the assistant's answer unless it is None, then a turn pair per follow-up."""
    if followups and answer is None:
        raise ValueError("follow-up questions need the first answer (include_answer=True)")
    messages = [{"role": "user", "content": user_content}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    for followup in followups:
        messages.append({"role": "user", "content": [{"type": "text", "text": followup["question"]}]})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": followup["answer"]}]})
    return messages


# Tasks a scene's caption answers: it names every shape's colour and kind (positions only as the
# left-to-right order, and no boxes or motion).
DESCRIBABLE_TASKS: tuple[str, ...] = ("count", "colour", "existence")


def as_described_messages(sample: dict, include_answer: bool = True, followups: Sequence[dict] = ()) -> list[dict]:
    """Text-only chat messages for a count, colour or existence sample: the scene's caption in place of
    the image, then the question ("A small red star on a plain background. Is there a red star?").

    The same matching the image questions need (find the shape named in the question, compare
    colour and kind) on words alone, which a language model trained from scratch learns far sooner
    than on visual tokens; see examples/train_shapes.py."""
    for item in (sample, *followups):
        if item["task"] not in DESCRIBABLE_TASKS or item.get("video"):
            raise ValueError(f"a {item['task']!r} sample cannot be answered from its caption; "
                             f"describable tasks: {', '.join(DESCRIBABLE_TASKS)}")
    description = caption_of(sample["scene"])
    text = f"{description[0].upper()}{description[1:]} {sample['question']}"
    return _chat([{"type": "text", "text": text}], sample["answer"] if include_answer else None, followups)


def _allowed_combos(sample: dict) -> set[tuple[str, str]]:
    """The colour-kind pairs a question about this sample may name: held-out ones only in held-out samples."""
    return set(SEEN_COMBOS) | (set(HELDOUT_COMBOS) if sample.get("heldout") else set())


def existence_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """`count` (even) existence questions about one sample's scene, as samples in shuffled order: half
    name a shape in it ("yes"), half change one word of one ("no"), taking turns between its colour
    on a kind the scene lacks in that colour and its kind in a colour the scene lacks for it.

    Trained side by side in one batch, these are minimal pairs: the same scene answered "yes" and
    "no" by phrases one word apart, so the answer prior cancels and only checking both the colour and
    the kind lowers the loss. On described scenes (examples/probe_text_matching.py), a fresh 4-layer
    language model given one existence question per scene still answers every question the same
    after 900 steps; given these four, it gets 78% of one-shape scenes right after 900.

    Deterministic in (sample, seed, count); held-out colour-kind pairs are never named unless the
    sample is itself held-out."""
    if count < 2 or count % 2:
        raise ValueError(f"count must be even and at least 2 (half yes, half no), got {count}")
    rng = np.random.default_rng([int(seed), int(count), 0x5EED])
    present = {(s["colour"], s["kind"]) for s in sample["scene"]["shapes"]}
    allowed = _allowed_combos(sample)
    named = sorted(present & allowed) or sorted(present)

    def pick(options):
        return options[int(rng.integers(len(options)))]

    def one_word_off(change_kind: bool) -> tuple[str, str]:
        for colour, kind in [named[i] for i in rng.permutation(len(named))]:
            other_kinds = [(colour, k) for k in KINDS if (colour, k) not in present and (colour, k) in allowed]
            other_colours = [(c, kind) for c in COLOURS if (c, kind) not in present and (c, kind) in allowed]
            options = (other_kinds or other_colours) if change_kind else (other_colours or other_kinds)
            if options:
                return pick(options)
        raise ValueError(f"no colour-kind pair one word off the scene's {sorted(present)} is allowed")

    first_changes_kind = bool(rng.integers(2))
    combos = [pick(named) for _ in range(count // 2)]
    combos += [one_word_off(change_kind=(i % 2 == 0) == first_changes_kind) for i in range(count // 2)]
    questions = []
    for i in rng.permutation(count):
        combo = combos[i]
        template = int(rng.integers(len(TEMPLATES["existence"])))
        found = combo in present
        questions.append(dict(sample, task="existence", template=template, answer="yes" if found else "no",
                              question=TEMPLATES["existence"][template].format(a_obj=_article(_name(combo))),
                              query={"colour": combo[0], "kind": combo[1], "present": found}))
    return questions


def count_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """`count` count questions about one sample's scene, as samples in shuffled order: the three
    variants in turn ("How many shapes?", "How many red shapes?", "How many stars?"), the colour and
    kind ones taking turns between a value the scene shows and one it lacks (answered "0"; one
    `make_sample` question names a value it shows half the time, else any value).

    The counterpart of `existence_questions` for count: one scene answered "2", "0" and "1" by
    questions a word apart, so the answer prior cancels and only counting what the question names
    lowers the loss. From two questions on, a group always holds a colour or kind it shows and one
    it lacks, so at least two answers. A count question about a one-shape scene is an existence question in other
    words, which one question per scene did not teach (benchmarks/results/shapes_experiments.md).

    Deterministic in (sample, seed, count). Naming a colour or a kind alone never names a held-out
    colour-kind pair, since every colour and every kind has seen pairs."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    rng = np.random.default_rng([int(seed), int(count), 0xC0DE])
    shapes = sample["scene"]["shapes"]
    first = int(rng.integers(3))
    variants = [("all", "colour", "kind")[(first + i) % 3] for i in range(count)]
    questions, named = [], 0
    for variant in variants:
        value = None
        if variant != "all":
            present = sorted({s[variant] for s in shapes})
            absent = [v for v in (KINDS if variant == "kind" else COLOURS) if v not in present]
            values = present if named % 2 == 0 or not absent else absent
            named += 1
            value = values[int(rng.integers(len(values)))]
        questions.append(_count_question(sample, variant, value, rng))
    return [questions[i] for i in rng.permutation(count)]


def _count_question(sample: dict, variant: str, value: str | None, rng: np.random.Generator) -> dict:
    """One count question about the sample's scene, as a sample: all its shapes (`variant` "all",
    `value` None), or those of one colour or kind (`variant` "colour" or "kind", `value` the one
    named), answered by counting them. Draws one number from `rng`, the phrasing."""
    shapes = sample["scene"]["shapes"]
    if variant == "all":
        answer, query, fields = len(shapes), {"variant": "all"}, {}
    else:
        answer = sum(s[variant] == value for s in shapes)
        query = {"variant": variant, variant: value}
        fields = {"kinds": PLURALS[value]} if variant == "kind" else {"colour": value}
    key = f"count_{variant}"
    template = int(rng.integers(len(TEMPLATES[key])))
    return dict(sample, task="count", template=template, answer=str(answer), query=query,
                question=TEMPLATES[key][template].format(**fields))


def _nameable_shapes(sample: dict) -> list[dict]:
    """The scene's shapes that a question can name by colour and kind alone: their pair is unique in
    the scene, and allowed (`_allowed_combos`)."""
    shapes = sample["scene"]["shapes"]
    combos = Counter((s["colour"], s["kind"]) for s in shapes)
    allowed = _allowed_combos(sample)
    return [s for s in shapes if combos[(s["colour"], s["kind"])] == 1 and (s["colour"], s["kind"]) in allowed]


def position_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """`count` (even) position questions about one sample's scene, as samples in shuffled order: half
    the pairs of shapes it asks about, each asked both ways ("Where is A relative to B?" and "... B
    relative to A?"), whose answers are opposite.

    The counterpart of `existence_questions` for position: side by side in one batch, the two orders
    of a pair name the same two shapes and differ only in which comes first, so the answer prior
    cancels and only binding each name to its own shape lowers the loss. The pairs are drawn from
    the shapes whose colour and kind are unique in the scene and that stand in one clear relation
    (`relation` with the scene's position margin; a position sample always has one such pair).

    Deterministic in (sample, seed, count); held-out colour-kind pairs are never named unless the
    sample is itself held-out."""
    if count < 2 or count % 2:
        raise ValueError(f"count must be even and at least 2 (each pair asked both ways), got {count}")
    rng = np.random.default_rng([int(seed), int(count), 0x9051])
    scene = sample["scene"]
    unique = _nameable_shapes(sample)
    margin = _position_margin(scene["width"], scene["height"])
    pairs = [(a, b) for i, a in enumerate(unique) for b in unique[i + 1:] if relation(a["box"], b["box"], margin)]
    if not pairs:
        raise ValueError(f"no two shapes of unique, allowed colour and kind stand in a clear relation in the scene "
                         f"({len(scene['shapes'])} shapes, {len(unique)} unique)")
    asked = []
    for _ in range(count // 2):
        a, b = pairs[int(rng.integers(len(pairs)))]
        asked += [(a, b), (b, a)]
    questions = []
    for i in rng.permutation(count):
        a, b = asked[i]
        template = int(rng.integers(len(TEMPLATES["position"])))
        query = {"a": {"colour": a["colour"], "kind": a["kind"]}, "b": {"colour": b["colour"], "kind": b["kind"]}}
        questions.append(dict(sample, task="position", template=template, answer=relation(a["box"], b["box"], margin),
                              question=TEMPLATES["position"][template].format(a=f"{a['colour']} {a['kind']}",
                                                                             b=f"{b['colour']} {b['kind']}"),
                              query=query))
    return questions


CENTRE = "centre of the image"  # what a `centre_questions` question names in the position templates' {b}


def centre_relation(box: Sequence[float], width: int, height: int, margin: float = 0.1) -> str | None:
    """Where a box's centre is relative to the image's centre, as a fraction of the image's width and
    height: "left", "right", "above" or "below" when that offset is at least `margin` along one axis
    and at least 1.5 times the offset along the other, else None."""
    (x, y) = centre(box)
    dx, dy = x / width - 0.5, y / height - 0.5
    if abs(dx) >= max(margin, 1.5 * abs(dy)):
        return "left" if dx < 0 else "right"
    if abs(dy) >= max(margin, 1.5 * abs(dx)):
        return "above" if dy < 0 else "below"
    return None


def centre_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """Up to `count` position questions about one sample's scene that name one shape and the image's
    centre ("Where is the red star relative to the centre of the image?"), each shape once, in the
    position templates and answers. The shapes asked about are those a question can name alone
    (`_nameable_shapes`) that stand in a clear relation to the centre (`centre_relation`); an empty
    list when there are none.

    A precursor of position: one shape to find instead of two, and its place to read off, not
    compare. Over exact visual tokens that carry each cell's place, a language model trained on
    position alone answered every question the same for 1,500 steps (benchmarks/results/
    shapes_experiments.md): until its attention singles out the named shapes, the places it pools do
    not depend on the answer, so nothing teaches it to single them out. Here the one named shape's
    place decides the answer. Deterministic in (sample, seed, count)."""
    rng = np.random.default_rng([int(seed), int(count), 0xCE17])
    scene = sample["scene"]
    clear = [(s, centre_relation(s["box"], scene["width"], scene["height"])) for s in _nameable_shapes(sample)]
    clear = [(s, answer) for s, answer in clear if answer]
    questions = []
    for i in rng.permutation(len(clear))[:count]:
        shape, answer = clear[i]
        template = int(rng.integers(len(TEMPLATES["position"])))
        questions.append(dict(sample, task="position", template=template, answer=answer,
                              question=TEMPLATES["position"][template].format(a=f"{shape['colour']} {shape['kind']}",
                                                                             b=CENTRE),
                              query={"a": {"colour": shape["colour"], "kind": shape["kind"]}, "b": CENTRE}))
    return questions


# Three more precursors, of captions: the background and a shape's size are in every caption and in no
# other task's answer, so nothing else teaches the language model to read them off the image; and a
# shape's kind is in every caption but other tasks only name it in their questions, never answer it.
ATTRIBUTE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "background": ("What is the background like?", "Which background does the image have?",
                   "Describe the background in one word.", "Is the background plain, striped, checkered or speckled?"),
    "size": ("Is the {obj} small or large?", "What size is the {obj}?", "How big is the {obj}: small or large?",
             "Is the {obj} large or small?"),
    "kind": ("What shape is the {colour} one?", "Which shape is {colour}?", "What is the {colour} shape?",
             "Name the {colour} shape.", "What kind of shape is {colour}?"),
}


def background_questions(sample: dict, seed: int, count: int = 1) -> list[dict]:
    """One question about a still sample's background ("What is the background like?"; answers
    plain / striped / checkered / speckled, the caption's word), as a list for symmetry with the other
    precursors (`count` 0 gives none). Deterministic in (sample, seed)."""
    if count < 1:
        return []
    template = int(np.random.default_rng([int(seed), 0xBAC6]).integers(len(ATTRIBUTE_TEMPLATES["background"])))
    return [dict(sample, task="background", template=template, question=ATTRIBUTE_TEMPLATES["background"][template],
                 answer=BACKGROUND_WORDS[sample["scene"]["background"]["type"]], query={})]


def _attribute_questions(sample: dict, task: str, shapes: list[dict], named_by: Sequence[str],
                         rng: np.random.Generator, count: int) -> list[dict]:
    """Up to `count` of `shapes` in a random order, each asked for its `task` attribute in a random
    ATTRIBUTE_TEMPLATES[task] phrasing that names it by its `named_by` attributes (as {obj}, all of
    them in order, or each by its own name)."""
    questions = []
    for i in rng.permutation(len(shapes))[:count]:
        shape = shapes[i]
        query = {name: shape[name] for name in named_by}
        template = int(rng.integers(len(ATTRIBUTE_TEMPLATES[task])))
        questions.append(dict(sample, task=task, template=template, answer=shape[task], query=query,
                              question=ATTRIBUTE_TEMPLATES[task][template].format(obj=" ".join(query.values()), **query)))
    return questions


def size_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """Up to `count` questions about the sizes of one still sample's shapes ("Is the red star small or
    large?"; answers small / large, the caption's words), each shape once, of those a question can
    name alone (`_nameable_shapes`). Deterministic in (sample, seed, count)."""
    rng = np.random.default_rng([int(seed), int(count), 0x512E])
    return _attribute_questions(sample, "size", _nameable_shapes(sample), ("colour", "kind"), rng, count)


def kind_questions(sample: dict, seed: int, count: int = 4) -> list[dict]:
    """Up to `count` questions that name a shape by its colour and ask for its kind ("What shape is the
    red one?"; answers the caption's kind words), each shape once, of those whose colour is unique in
    the scene and whose colour-kind pair is allowed (`_nameable_shapes`): the colour question turned
    round. Existence teaches the language model to match a kind it is told against the image; a
    caption needs it to say one, which only captions asked for before, and their kinds stayed at
    chance. Deterministic in (sample, seed, count)."""
    rng = np.random.default_rng([int(seed), int(count), 0x1C1D])
    colours = Counter(s["colour"] for s in sample["scene"]["shapes"])
    shapes = [s for s in _nameable_shapes(sample) if colours[s["colour"]] == 1]
    return _attribute_questions(sample, "kind", shapes, ("colour",), rng, count)


def scene_questions(sample: dict, seed: int, count: int, tasks: Sequence[str] = TASKS) -> list[dict]:
    """Up to `count` more questions about one image sample's scene, as samples sharing its image (task,
    question, answer, query and template replaced), for a conversation that asks them one after
    another (`as_messages(sample, followups=...)`).

    Each is drawn like make_sample's question of its task, but from the scene as it is: a colour,
    position or grounding question names a shape whose colour and kind are unique in the scene; a
    count asks for all shapes, a kind or a colour (present or not); existence names a shape in the
    scene or one word off one (`existence_questions`), by a coin, so that no answer follows from the
    ones before it. Nothing already asked (the sample's own question among them) is asked again in
    any phrasing, so the caption comes at most once and fewer than `count` come back when the scene
    offers fewer. Videos get none (their one task is motion).

    Asked together about one image, the questions share the image's tokens (one image encoded,
    several answers learned), and only reading each question tells their answers apart.
    Deterministic in (sample, seed, count, tasks); held-out colour-kind pairs are named only in
    held-out samples."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {TASKS}")
    askable = [t for t in tasks if t != "motion"]
    if sample.get("video") or sample.get("image") is None or not askable or not count:
        return []
    rng = np.random.default_rng([int(seed), int(count), 0x5CE7E])
    scene = sample["scene"]
    shapes = scene["shapes"]
    unique = _nameable_shapes(sample)
    margin = _position_margin(scene["width"], scene["height"])

    def pick(options):
        return options[int(rng.integers(len(options)))]

    def phrased(task: str, key: str, answer: str, query: dict, **fields) -> dict:
        template = int(rng.integers(len(TEMPLATES[key])))
        return dict(sample, task=task, template=template, answer=answer, query=query,
                    question=TEMPLATES[key][template].format(**fields))

    def ask(task: str) -> list[dict]:
        if task == "caption":
            return [phrased("caption", "caption", caption_of(scene), {})]
        if task == "count":
            variant = ("all", "kind", "colour")[int(rng.integers(3))]
            value = None
            if variant != "all":
                # half the time a value in the scene, else any (so "0" is asked too); every colour and kind
                # has seen pairs, so naming one alone never names a held-out pair
                present = sorted({s[variant] for s in shapes})
                value = pick(present) if rng.random() < 0.5 else pick(list(KINDS if variant == "kind" else COLOURS))
            return [_count_question(sample, variant, value, rng)]
        if task == "colour":
            kinds = Counter(s["kind"] for s in shapes)
            options = [s for s in unique if kinds[s["kind"]] == 1]
            if not options:
                return []
            shape = pick(options)
            return [phrased("colour", "colour", shape["colour"], {"kind": shape["kind"]}, kind=shape["kind"])]
        if task == "existence":
            try:  # one of a minimal pair: "yes" or "no" by a coin, so one answer never gives away the next
                return [pick(existence_questions(sample, int(rng.integers(2**31)), 2))]
            except ValueError:  # every one-word-off pair is held out: nothing to ask
                return []
        if task == "position":
            related = [(a, b, relation(a["box"], b["box"], margin)) for a in unique for b in unique if a is not b]
            pairs = [pair for pair in related if pair[2] is not None]
            if not pairs:
                return []
            a, b, where = pick(pairs)
            query = {"a": {"colour": a["colour"], "kind": a["kind"]}, "b": {"colour": b["colour"], "kind": b["kind"]}}
            return [phrased("position", "position", where, query,
                            a=f"{a['colour']} {a['kind']}", b=f"{b['colour']} {b['kind']}")]
        if task == "grounding":
            if not unique:
                return []
            shape = pick(unique)
            box = format_box(box_to_relative(shape["box"], scene["width"], scene["height"]))
            return [phrased("grounding", "grounding", box, {"colour": shape["colour"], "kind": shape["kind"]},
                            obj=f"{shape['colour']} {shape['kind']}")]
        raise AssertionError(task)

    def key(item: dict) -> str:  # what a question asks, whatever its phrasing
        query = {k: v for k, v in item["query"].items() if k != "present"}
        return json.dumps([item["task"], query], sort_keys=True)

    # tasks in turn, each round in a fresh order, so a conversation mixes them evenly
    asked, questions = {key(sample)}, []
    order = [t for _ in range(4 * count) for t in rng.permutation(askable)]
    for task in order[:4 * count]:  # some draws come back empty or already asked
        if len(questions) >= count:
            break
        for question in ask(str(task)):
            if key(question) not in asked and len(questions) < count:
                asked.add(key(question))
                questions.append(question)
    return questions


def blank_like(sample: dict, colour: Sequence[int] = (235, 235, 235)) -> dict:
    """The same sample (question, answer, scene) with a uniform blank image, or video of blank frames of
    the same count, in place of the pixels: the blank-image baseline."""
    out = dict(sample)
    if sample.get("video"):
        frames = list(sample["video"])
        out["video"] = [blank_image(f.width, f.height, colour) for f in frames]
        out["hash"] = content_hash(out["video"])
    elif sample.get("image") is not None:
        out["image"] = blank_image(sample["image"].width, sample["image"].height, colour)
        out["hash"] = content_hash(out["image"])
    out["blank"] = True
    return out


def majority_answers(split) -> dict[str, tuple[str, float]]:
    """{task: (most common answer, its rate among that task's samples)} for a datasets.Dataset (only its
    task and answer columns are read) or an iterable of samples; ties go to the smallest answer."""
    if hasattr(split, "column_names"):
        pairs = zip(split["task"], split["answer"])
    else:
        pairs = ((s["task"], s["answer"]) for s in split)
    counts: dict[str, Counter] = {}
    for task, answer in pairs:
        counts.setdefault(task, Counter())[answer] += 1
    result = {}
    for task in sorted(counts, key=lambda t: TASKS.index(t) if t in TASKS else len(TASKS)):
        answer, hits = min(counts[task].items(), key=lambda item: (-item[1], item[0]))
        result[task] = (answer, hits / sum(counts[task].values()))
    return result


def normalise_answer(text: str) -> str:
    return " ".join(str(text).strip().lower().split()).rstrip(".").strip()


def grade(task: str, prediction: str, answer: str, iou_threshold: float = 0.5) -> bool:
    """Exact match after normalise_answer (lower case, single spaces, no final period); grounding instead
    needs IoU(prediction's box, answer's box) >= iou_threshold."""
    if task == "grounding":
        return iou(parse_box(prediction), parse_box(answer)) >= iou_threshold
    return normalise_answer(prediction) == normalise_answer(answer)


__all__ = [
    "ANSWER_SETS", "BACKGROUNDS", "COLOURS", "CURRICULUM", "DEFAULTS", "DIRECTIONS", "HELDOUT_COMBOS", "KINDS",
    "RELATIONS", "SEEN_COMBOS", "SIZES", "SPLITS", "TASKS", "TEMPLATES", "as_described_messages",
    "as_messages", "blank_like", "existence_questions", "scene_questions",
    "ATTRIBUTE_TEMPLATES", "CAPTION_FIELDS", "background_questions", "box_errors", "box_to_relative",
    "build_dataset", "caption_field_hits", "caption_of", "content_hash", "format_box", "generate_split", "grade",
    "iou", "iter_samples", "majority_answers", "make_sample", "normalise_answer", "parse_box", "parse_caption", "relation",
    "relative_box", "relative_to_box", "render_scene", "render_video", "sample_seed", "size_questions",
]

"""Train the small ShapesWorld model that ships with vlmkit, from scratch, on this CPU.

    python examples/train_shapes.py --out vlmkit/default_model            # the full run
    python examples/train_shapes.py --smoke --out /tmp/shapes-smoke       # 20 steps, a tiny model (CI)

Steps: (1) train a byte-level BPE tokenizer on ShapesWorld questions and answers; (2) build a small
vlmkit model (merger connector, DeepStack on) and its processor; (3) stage 1, --vision-steps: train
the vision tower and merger alone on dense labels read off the scene description (every merged token:
the kind and colour of the shape it shows, scored against the language model's embeddings of those
names, or background; whether a shape's centre is in it; with --structured-heads place, the shape's
offset from the image's centre; in the last --motion-steps, clips too, and which way the token's
shape moves; --recolour-share 0.5: half the shapes drawn in off-palette fills, labelled with their
kind only, so kinds are learned apart from colours); (4) stage 2: train the language model
and the DeepStack mergers with Trainer, the tower frozen (--vision-lr-scale 0), on fresh samples
drawn on the fly (a sample is a seed, so data never repeats and costs about 1 ms). It opens with
--opening-steps of colour, existence and count on full scenes, existence as minimal pairs
(--existence-group 8: eight questions about one scene side by side, half one word off; with
--opening-bar, existence is checked at the opening's end and a missed opening starts over from
stage 1's weights on the next seed's samples, `OpeningCheck`), then
--centre-steps of centre questions alone ("Where is the red star relative to the centre of the
image?", the step before position), then follows a curriculum that starts on small, plain scenes and the one-word tasks (--text-steps / --text-every
can also give count, colour and existence as scenes described in words; off by default); (4b)
--polish-steps, a short second run (fresh optimizer, cosine from --polish-lr) over
--polish-tasks in turn on full scenes, to relearn what the curriculum's last tasks crowded out
(--init-from DIR runs only this on a saved model; --stage2-cache FILE keeps the model before it, so that
polish variants over one stage 2 need not repeat stages 1 and 2); (5) save
model (bf16 safetensors) + processor, and write the learning curves next to them: stage 1's token
accuracies, the loss, and every --eval-every steps the exact-match rate per task on fixed validation
questions with the real image and with a blank one (the gap is what the model gets from looking).

What makes it learn (measured on 64-128 px probes): a learning rate of 5e-4, not 2e-3 (at 1e-3 and
above the loss spikes and the model never leaves the language-prior plateau; at 5e-4 it starts
using the image after 150-250 steps), Adam beta2 0.95, and each sample weighing the same in the
loss (`per_sample_loss`), so that captions do not drown the one-word answers.
"""

import argparse
import colorsys
import copy
import itertools
import json
import math
import os
import platform
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainingArguments, get_cosine_schedule_with_warmup

import vlmkit
from vlmkit.data import (
    COLOURS, CURRICULUM, DESCRIBABLE_TASKS, KINDS, TASKS, as_described_messages, as_messages, blank_like,
    background_questions, centre_questions, count_questions, existence_questions, kind_questions, make_sample, position_questions,
    scene_questions, size_questions,
)
from vlmkit.data.shapes import (
    BACKGROUNDS, DIRECTIONS, HELDOUT_COMBOS, SIZES, cell_attributes, cell_labels, cell_owners, content_hash, render_scene,
    video_cell_labels,
)
from vlmkit.data.shapesworld import BACKGROUND_WORDS, TEMPLATES
from vlmkit.training import IGNORE_INDEX, LOSS_FUNCTIONS, VLMKitDataCollator, VLMKitTrainer

# Share of the run spent at each curriculum level (vlmkit.data.CURRICULUM: easy -> full), and the
# tasks trained at each: one-word answers first, then relations, boxes and captions.
CURRICULUM_SCHEDULE = (0.25, 0.35, 0.40)
# --tasks, --opening-tasks and --polish-tasks also take precursors, not evaluation tasks: "centre", of
# position, one shape's place relative to the image's centre (`vlmkit.data.centre_questions`); and
# "background" and "size", of captions, which say both and no other task asks about them
# (`vlmkit.data.background_questions`, `size_questions`); and "kind", of captions too, which say a
# shape's kind where other tasks only name it (`kind_questions`: "What shape is the red one?")
CENTRE, BACKGROUND, SIZE, KIND = "centre", "background", "size", "kind"
PRECURSORS = (CENTRE, BACKGROUND, SIZE, KIND)
STREAM_TASKS = (*TASKS, *PRECURSORS)
# (not background at level 0: its scenes are all plain)
LEVEL_TASKS = (("count", "colour", "existence", "motion", CENTRE, SIZE, KIND), STREAM_TASKS, STREAM_TASKS)
# What --opening-steps train before the curriculum: the tasks examples/probe_ideal_tower.py trains.
OPENING_TASKS = ("colour", "existence", "count")
# What --polish-steps train after it, in turn: captions in every other slot, as the polish is where the
# captions are learned (3 of 19 slots gave 3.7% exact captions, 16 of 32-34 gave 9-17%); between them, existence
# (minimal pairs, binding colour to kind) most, as the centre steps and the curriculum left it furthest
# behind, the kind and background precursors of captions, and grounding and count three times each,
# which the captions' slots would otherwise crowd out (benchmarks/results/shapes_experiments.md, 49-53)
POLISH_BETWEEN_CAPTIONS = ("existence", "colour", "existence", "count", "colour", "position", "existence", CENTRE,
                           "motion", "count", "grounding", BACKGROUND, KIND, "position", KIND, "grounding")
POLISH_TASKS = (*(task for other in POLISH_BETWEEN_CAPTIONS for task in (other, "caption")), "grounding", "count")
# What the curriculum trains, in turn: the seven tasks, centre, position a second time, and the kind
# and background precursors of captions
CURRICULUM_TASKS = (*TASKS, CENTRE, "position", BACKGROUND, KIND)


def check_stream_tasks(tasks, name: str) -> None:
    """Raise a ValueError naming the `tasks` that a ShapesStream cannot draw (`name`: what they were given as)."""
    if not set(tasks) <= set(STREAM_TASKS):
        raise ValueError(f"{name} {', '.join(sorted(set(tasks) - set(STREAM_TASKS)))} are neither "
                         f"ShapesWorld tasks ({', '.join(TASKS)}) nor precursors ({', '.join(PRECURSORS)})")


PRECURSOR_QUESTIONS = {CENTRE: centre_questions, BACKGROUND: background_questions, SIZE: size_questions,
                       KIND: kind_questions}


def precursor_samples(task: str, seed: int, count: int, **options) -> list[dict]:
    """`count` questions of a precursor task (`PRECURSOR_QUESTIONS`, their task set to it), from the
    still scenes drawn from `seed` on (seeds step by a large prime): as many as each scene offers (a
    background question one, centre questions one per shape clear of the image's centre), so a
    group of them keeps its share of the batch on scenes of one or two shapes too. `options` go to
    make_sample. Deterministic in the seed."""
    questions = []
    for attempt in range(100 * count):
        sample = make_sample(seed + 7_919_113 * attempt, task="colour", **options)
        questions += [dict(q, task=task) for q in PRECURSOR_QUESTIONS[task](sample, seed + attempt, count - len(questions))]
        if len(questions) == count:
            return questions
    raise RuntimeError(f"the scenes from seed {seed} offered fewer than {count} {task} questions in {100 * count} draws")


def centre_samples(seed: int, count: int, **options) -> list[dict]:
    """`count` centre questions (`precursor_samples`)."""
    return precursor_samples(CENTRE, seed, count, **options)


def tokenizer_corpus(num_samples: int = 4000, role_words: bool = False) -> list[str]:
    texts = [phrase for phrases in TEMPLATES.values() for phrase in phrases]
    for i in range(num_samples):
        sample = make_sample(i, task=TASKS[i % len(TASKS)])
        texts += [sample["question"], sample["answer"]]
    texts += [f"<{t / 10:.1f} seconds>" for t in range(0, 100)]
    if role_words:  # the chat template's role lines, as often as turns: one token each, not 4 and 8 letters
        texts += ["user\n", "assistant\n"] * num_samples
    return texts


def shapes_tokenizer(smoke: bool = False, words: bool = False):
    """The BPE tokenizer train_shapes.py trains. `words` (--word-tokenizer): room for 1,024 tokens and
    the chat template's role lines in the corpus, so that each role name and every ShapesWorld word
    after a space is one token, and so is an answer of the seven tasks ("purple", which the default
    spells "p" "urple"); digits split as Qwen's are. The precursors' one-word answers (a kind, a size
    or a background type, with no space before it) are still spelled in pieces by both."""
    return vlmkit.build_tokenizer(tokenizer_corpus(300 if smoke else 4000, role_words=words),
                                  vocab_size=1024 if words else 512, split_digits=words)


def mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) frequency split in Qwen3-VL's proportions (24, 20, 20 of 64)."""
    half = head_dim // 2
    spatial = half * 20 // 64
    return [half - 2 * spatial, spatial, spatial]


# Connector settings scaled to the small model (the defaults are BLIP-2 / Idefics2 sized).
SMALL_CONNECTORS = {
    "merger": {}, "mlp": {},
    "qformer": dict(num_queries=16, qformer_hidden_size=128, qformer_num_layers=2, qformer_num_heads=4,
                    qformer_intermediate_size=256),
    "resampler": dict(num_latents=16, resampler_depth=2, resampler_num_heads=4, resampler_head_dim=32,
                      resampler_num_key_value_heads=2, resampler_intermediate_size=256),
}


def model_config(tokenizer, smoke: bool, connector_type: str = "merger") -> vlmkit.VLMKitConfig:
    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    vocab = 64 * math.ceil(len(tokenizer) / 64)
    width, layers = (64, 2) if smoke else (256, 4)
    return vlmkit.VLMKitConfig(
        text_config=dict(vocab_size=vocab, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4,
                         max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": mrope_section(width // 4)}),
        vision_config=dict(depth=layers, hidden_size=width // 2, intermediate_size=2 * width, num_heads=4, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=width,
                           num_position_embeddings=144, deepstack_visual_indexes=list(range(layers - 1))),
        image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3],
        tie_word_embeddings=True, connector_type=connector_type, connector_config=SMALL_CONNECTORS[connector_type],
    )


def build_model_and_processor(tokenizer, smoke: bool, connector_type: str = "merger"):
    """A fresh model (generation settings from the tokenizer) and its processor, whose pixel budgets
    fit ShapesWorld's 96-192 px images (32 px = patch 16 x merge 2)."""
    config = model_config(tokenizer, smoke, connector_type)
    model = vlmkit.VLMKitForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.max_new_tokens = 48
    image_processor = vlmkit.VLMKitImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256})
    video_processor = vlmkit.VLMKitVideoProcessor(size={"shortest_edge": 2 * 32 * 32, "longest_edge": 8 * 256 * 256})
    processor = vlmkit.VLMKitProcessor.for_model(config, tokenizer, image_processor=image_processor,
                                                 video_processor=video_processor)
    return model, processor


# ----------------------------------------------------------------------- stage 1: vision pretraining
# The VLM alone learns kinds slowly: its only signal for "star" is a few answer tokens per sample, and
# after 90 minutes it named a lone shape's kind 9 times in 40. Dense labels from the scene description
# (every merged token: which kind, which colour, whether a shape's centre) teach the tower in minutes.
DENSE_HEADS = {"kind": len(KINDS) + 1, "colour": len(COLOURS) + 1, "centre": 2}
IMAGE_TASKS = tuple(t for t in TASKS if t != "motion")
# In its last --motion-steps, stage 1 also shows clips (one sample in len(TASKS)), and every token
# learns which way the shape it shows moves ("still" on background, on static shapes and on every
# image token), scored like kind and colour against the words (" left" ...). Without them the tower
# sees only stills, whose two frames per temporal patch are equal, so the half of the Conv3d patch
# embedding that sees a frame difference keeps its random init, and a frozen tower cannot learn it in
# stage 2. Only the last steps: with clips from the start, kinds were learned far slower (35% of shape
# tokens at step 2,250 against 78%), while directions need about 1,000 steps (95% of moving tokens).
STILL = len(DIRECTIONS)
# --structured-heads also teach every token what makes a question one look-up instead of a count or
# a comparison over many tokens (vlmkit.data.shapes.cell_attributes, each by a linear head): the
# scene's shape count, how many shapes share this one's colour / kind (0 on background, the answer
# when the colour or kind asked about is absent), its size, its left-to-right rank (the background
# ranks after the last shape: what a caption says after it), the background type, the digits of
# its relative box in 12 places (11 on background), and where the cell is (x and y as fractions of
# the image, regressed: the language model's rotary positions never reach a token's value, so a
# comparison of two shapes' places needs the place in the token itself); and "place", the cell's
# offset from the image's centre on shape cells and 0 on background, read as a cosine so that it is a
# large share of the token (`PlaceHead`). examples/probe_ideal_tower.py --features measures what these
# buy the language model when they are exact. Two more are scored like kind and colour, against the
# language model's words, so that a caption can copy them: "background_word" (the background's
# tokens scored against " plain", " striped", ... in place of the kind head's learned background
# vector; "background_word_colour" the same in place of the colour head's) and "size_word" (a
# shape's tokens against " small" and " large"; no label on background).
MAX_SHAPES = 5
STRUCTURED_HEADS = {"total": MAX_SHAPES + 1, "colour_count": MAX_SHAPES + 1, "kind_count": MAX_SHAPES + 1,
                    "size": 3, "rank": MAX_SHAPES + 1, "background_type": len(BACKGROUNDS)}
BOX_PLACES, BOX_VALUES = 12, 12
WHERE_SCALE = 1000  # "where" travels in the int64 label columns as permille of the image's width and height
NAMED_CLASSES = {"kind": KINDS, "colour": COLOURS}  # the heads NameHeads scores against these words
BACKGROUND_WORD_HEADS = {"background_word": "kind", "background_word_colour": "colour"}  # -> the head that names it
WORD_HEADS = (*BACKGROUND_WORD_HEADS, "size_word")  # scored by NameHeads against words, not by a linear head
STRUCTURED_CHOICES = (*STRUCTURED_HEADS, "box_digits", "where", "place", *WORD_HEADS)
COUNT_HEADS = ("total", "colour_count", "kind_count")
# --count-heads cosine reads them as NameHeads reads the names: the cosine of the token with one learned
# direction per count, times a fixed temperature. A margin of m nats then needs the token to lean about
# m / (2 x temperature) or more of its direction toward the right count, so the counts hold a share of
# every token that the language model can read; a linear head grows its weights instead and leaves
# their size to chance. Over exact tokens (examples/probe_ideal_tower.py --features count
# --feature-scale 0.1), counts at 0.4-0.6 of a word row's norm took count on 3 and 5 shapes from 53 / 59%
# to 88 / 84% with colour and existence kept; at a word row's norm they drowned the names. The names'
# learned temperature stays near 10, where they take 0.39 (kind) and 0.44 (colour) of a shape token's
# direction; the counts at 10 took 0.24-0.37 each by step 750 and the kinds fell to half their pace.
# 25 asks for about 0.4 of that. At weight 1 each, the three counts' losses (log 6 each at the start,
# their gradients scaled by the temperature) held the names back from the first steps: colour 52% of
# shape tokens at step 250 against 66% at temperature 10 and 78% without count heads. So the three
# together weigh one name (--count-weight sets each one's weight). With these, over 4,000 stage-1
# steps and the opening, the total was learned and read ("How many shapes?" 97% against 81%), but the
# kinds ended 14 points behind and existence fell from 90% to 58%
# (benchmarks/results/shapes_experiments.md, session 43): not in the recipe. The total alone cost the
# same, at weight 1/3 and at 1/10: existence after the opening 60% (session 44). Taught for 1,000 steps
# after a place-only stage 1 (--stage1-init), the three kept the kinds but still cost existence 13 points
# against the same steps without them, and count did not rise (session 45).
COUNT_TEMPERATURE = 25.0
COUNT_LOSS_WEIGHT = 1 / 3
STRUCTURED_GROUPS = {"count": COUNT_HEADS,
                     "layout": ("size", "rank", "background_type", "box_digits", "where", "place"),
                     "all": STRUCTURED_CHOICES}


def structured_heads(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """"count,where" -> ("total", "colour_count", "kind_count", "where"): names and groups
    (STRUCTURED_GROUPS) expanded, in STRUCTURED_CHOICES' order; unknown names raise."""
    names = [n for n in (spec.split(",") if isinstance(spec, str) else spec) if n]
    unknown = sorted(set(names) - set(STRUCTURED_CHOICES) - set(STRUCTURED_GROUPS))
    if unknown:
        raise ValueError(f"unknown structured head(s) {unknown}; choose from "
                         f"{', '.join((*STRUCTURED_GROUPS, *STRUCTURED_CHOICES))}")
    chosen = {h for n in names for h in STRUCTURED_GROUPS.get(n, (n,))}
    return tuple(h for h in STRUCTURED_CHOICES if h in chosen)


def label_names(structured: tuple[str, ...], motion: bool) -> list[str]:
    """The one-column labels of dense_batch, in order; the 12 box digits, then where's x and y (which
    place is computed from) follow when `structured` has them."""
    return [*DENSE_HEADS, *(["motion"] if motion else []), *(h for h in STRUCTURED_HEADS if h in structured),
            *(["size_word"] if "size_word" in structured else [])]


def label_width(structured: tuple[str, ...], motion: bool) -> int:
    return len(label_names(structured, motion)) + BOX_PLACES * ("box_digits" in structured) + 2 * has_where(structured)


def has_where(structured: tuple[str, ...]) -> bool:
    """Whether dense_batch's labels end in where's two columns: the where and place heads read them."""
    return "where" in structured or "place" in structured


def dense_samples(seeds: list[int], split: str = "train", motion: bool = False) -> list[dict]:
    """Stage 1's scenes: tasks and curriculum levels mixed; with `motion`, every len(TASKS)-th a clip."""
    tasks = TASKS if motion else IMAGE_TASKS
    # consecutive seeds cycle through the tasks, and through the levels every len(tasks) seeds
    return [make_sample(seed, task=tasks[seed % len(tasks)], split=split,
                        difficulty=seed // len(tasks) % len(CURRICULUM)) for seed in seeds]


def dense_batch(processor, seeds: list[int], split: str = "train", structured: tuple[str, ...] = (), motion: bool = False,
                recolour: float = 0.0, recolour_kinds: dict[str, float] | None = None):
    """`dense_labels` of `dense_samples(seeds)`; with `recolour`, that share of the stills' shapes drawn
    in off-palette fills (`recoloured`, drawn from a generator seeded by `seeds`), and with
    `recolour_kinds`, another share for the kinds it names."""
    samples = dense_samples(seeds, split, motion)
    if recolour or recolour_kinds:
        rng = np.random.default_rng(seeds)
        samples = [recoloured(s, recolour, rng, recolour_kinds) if s["video"] is None else s for s in samples]
    return dense_labels(processor, samples, structured, motion)


# --recolour-share draws some of stage 1's shapes in fills outside the palette, labelled with their
# kind and no colour, so the tower cannot read a kind off its colour. Trained on the palette alone,
# the tower gave 76% of shape tokens their kind on the validation scenes and 48% on the same scenes
# in held-out colour-kind pairs (a red star; `heldout_pair_samples`); with half the shapes recoloured,
# 77% and 73%. The fills are hues between the palette's (COLOURS: 0-52, 129, 225 and 278 degrees;
# black) and greys, so no training image shows a held-out pair in any shade of its colour.
OFF_PALETTE_HUES = ((80, 105), (160, 190), (305, 330))  # degrees: lime, teal, magenta


def off_palette_rgb(rng: np.random.Generator) -> tuple[int, int, int]:
    """A fill no palette colour names: a grey (one in four) or a lime, teal or magenta of random
    saturation and brightness, dark enough to stand out on the light backgrounds."""
    if rng.random() < 0.25:
        return (int(rng.integers(90, 161)),) * 3
    lo, hi = OFF_PALETTE_HUES[int(rng.integers(len(OFF_PALETTE_HUES)))]
    rgb = colorsys.hsv_to_rgb(rng.uniform(lo, hi) / 360, rng.uniform(0.5, 1.0), rng.uniform(0.45, 0.8))
    return tuple(int(round(255 * v)) for v in rgb)


def recoloured(sample: dict, share: float, rng: np.random.Generator, kinds: dict[str, float] | None = None) -> dict:
    """A still `sample` with each shape, with probability `share` (or `kinds`' share for its kind), drawn
    in an off-palette fill (its "rgb"; `dense_labels` then ignores its colour), and the image redrawn."""
    kinds = kinds or {}
    shapes = [dict(s, rgb=off_palette_rgb(rng)) if rng.random() < kinds.get(s["kind"], share) else s
              for s in sample["scene"]["shapes"]]
    return redrawn(sample, shapes) if any("rgb" in s for s in shapes) else sample


def kind_shares(spec: str) -> dict[str, float]:
    """--recolour-kinds "circle=0.9,hexagon=0.9" -> {"circle": 0.9, "hexagon": 0.9} ("" -> {})."""
    shares = {}
    for item in filter(None, spec.split(",")):
        kind, _, share = item.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if kind not in KINDS or not 0 <= value <= 1:
            raise ValueError(f"{item!r} is not KIND=SHARE with a kind of {', '.join(KINDS)} and a share between 0 and 1")
        shares[kind] = value
    return shares


def heldout_pair_samples(seeds: list[int]) -> list[dict]:
    """Stage 1's validation stills (`dense_samples`) with every shape of a kind that has a held-out
    colour (HELDOUT_COMBOS: all but diamond) redrawn in that colour: the colour-kind pairs no training
    image shows, in scenes that are not test images."""
    heldout_colour = {kind: colour for colour, kind in HELDOUT_COMBOS}
    return [redrawn(sample, [dict(s, colour=heldout_colour.get(s["kind"], s["colour"])) for s in sample["scene"]["shapes"]])
            for sample in dense_samples(seeds, split="validation")]


def redrawn(sample: dict, shapes: list[dict]) -> dict:
    """A still `sample` whose scene holds `shapes` instead, its image (and the image's hash) drawn anew."""
    scene = dict(sample["scene"], shapes=shapes)
    image = render_scene(scene)
    return dict(sample, scene=scene, image=image, hash=content_hash(image))


def dense_labels(processor, samples: list[dict], structured: tuple[str, ...] = (), motion: bool = False):
    """ShapesWorld samples -> pixel_values, grid_thw and (N_tokens, columns) labels (`label_names`:
    kind, colour, centre; with `motion`, the direction; with `structured`, those heads' labels),
    token-aligned with the tower's merged output. The clips' patches, grids and labels follow the
    images' (a clip's tokens run over its temporal slices; its structured labels are -100, ignored:
    they describe still scenes)."""
    images, clips = [s for s in samples if s["video"] is None], [s for s in samples if s["video"] is not None]
    image_processor = processor.image_processor
    cell = image_processor.patch_size * image_processor.merge_size  # px each merged token sees
    width = label_width(structured, motion)
    pixel_values, grids, labels = [], [], []
    if images:
        inputs = image_processor(images=[s["image"] for s in images], return_tensors="pt")
        pixel_values.append(inputs["pixel_values"])
        grids.append(inputs["image_grid_thw"])
    for sample in images:
        owner = cell_owners(sample["scene"], cell=cell)
        cells = cell_labels(sample["scene"], cell=cell, owner=owner)
        off_palette = [i for i, s in enumerate(sample["scene"]["shapes"]) if "rgb" in s]  # `recoloured` shapes
        if off_palette:  # their colour names are not what they show
            cells["colour"] = np.where(np.isin(owner, off_palette), -100, cells["colour"])
        cells = background_word_labels(cells, sample["scene"], structured)
        columns = [cells[k] for k in DENSE_HEADS]  # each (rows, cols)
        if motion:
            columns.append(np.full_like(cells["kind"], STILL))
        if structured:
            attributes = cell_attributes(sample["scene"], cell=cell)
            if off_palette:  # counts of a colour name that some shapes do not show
                attributes["colour_count"] = np.full_like(attributes["colour_count"], -100)
            columns += [attributes[k] for k in STRUCTURED_HEADS if k in structured]
            if "size_word" in structured:  # small / large on shape cells, nothing to learn on background
                columns.append(np.where(attributes["size"] < len(SIZES), attributes["size"], -100))
            if "box_digits" in structured:
                columns += list(np.moveaxis(attributes["box_digits"], -1, 0))
            if has_where(structured):
                columns += list(np.moveaxis(np.rint(attributes["where"] * WHERE_SCALE).astype(np.int64), -1, 0))
        labels.append(torch.from_numpy(np.stack(columns, -1).reshape(-1, width)))  # (rows*cols, columns)
    if clips:
        videos = processor.video_processor(videos=[s["video"] for s in clips], return_tensors="pt",
                                           video_metadata=[{"fps": s["fps"]} for s in clips])
        pixel_values.append(videos["pixel_values_videos"])
        grids.append(videos["video_grid_thw"])
        temporal = processor.video_processor.temporal_patch_size
        for sample in clips:
            cells = video_cell_labels(sample["scene"], cell=cell, temporal_patch_size=temporal)
            cells = background_word_labels(cells, sample["scene"], structured)
            columns = [cells[k] for k in [*DENSE_HEADS, "motion"]]  # each (T, rows, cols)
            columns += [np.full_like(cells["kind"], -100)] * (width - len(columns))
            labels.append(torch.from_numpy(np.stack(columns, -1).reshape(-1, width)))  # (T*rows*cols, columns)
    # (P, C*T*p*p), (B, 3), (N, columns)
    return torch.cat(pixel_values), torch.cat(grids), torch.cat(labels)


def background_word_labels(cells: dict[str, np.ndarray], scene: dict, structured: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`cell_labels` with the background's cells of the head that names the background type
    (BACKGROUND_WORD_HEADS, if `structured` has one) pointing at the type's word, which NameHeads
    lists after that head's names: len(names) + its index in BACKGROUNDS."""
    cells = dict(cells)
    for word_head, head in BACKGROUND_WORD_HEADS.items():
        if word_head in structured:
            names = len(NAMED_CLASSES[head])
            cells[head] = np.where(cells[head] == names, names + BACKGROUNDS.index(scene["background"]["type"]), cells[head])
    return cells


def name_token_ids(tokenizer, words) -> list[list[int]]:
    """Each word's token ids as the language model reads it after a space (" star")."""
    return [tokenizer(" " + word, add_special_tokens=False)["input_ids"] for word in words]


class NameHeads(torch.nn.Module):
    """Stage 1's probes on the merged visual tokens, dropped afterwards. Kind and colour are scored by
    cosine similarity with the language model's own embeddings of their names (" star", " red"; and a
    learned vector for background), times a learned temperature. So the tower learns to put a red
    star's tokens near embed(" star") and embed(" red"), and stage 2's language model starts with
    visual tokens in its own word space, where "is there a red star?" is a match between tokens it
    reads anyway (LLaVA's alignment stage does the same with captions). It also teaches kinds faster:
    91% kind accuracy after 4,000 steps, 85% with separate linear heads. The centre flag keeps a
    linear head. With `motion`, a token's direction is scored the same way against " left", " right",
    " up", " down" and a learned "still" vector."""

    def __init__(self, embed: torch.nn.Embedding, tokenizer, width: int, structured: tuple[str, ...] = (), motion: bool = False,
                 count_heads: str = "linear", count_weight: float = COUNT_LOSS_WEIGHT):
        super().__init__()
        self.count_weight = count_weight  # each cosine count head's loss against a name's (loss_weight)
        self.embed = embed  # the language model's: stage 1 trains the name rows too
        self.structured_names = structured_heads(tuple(structured))
        self.background_named_by = [head for word_head, head in BACKGROUND_WORD_HEADS.items() if word_head in self.structured_names]
        background_words = [BACKGROUND_WORDS[b] for b in BACKGROUNDS]
        self.name_ids = {head: name_token_ids(tokenizer, [*names, *(background_words if head in self.background_named_by else [])])
                         for head, names in NAMED_CLASSES.items()}
        if motion:
            self.name_ids["motion"] = name_token_ids(tokenizer, DIRECTIONS)
        if "size_word" in self.structured_names:
            self.name_ids["size_word"] = name_token_ids(tokenizer, SIZES)
        # a learned class after the names, for the cells that show none of them (size has no such cells,
        # and with background words the background has its own names)
        unnamed = [n for n in self.name_ids if n != "size_word" and n not in self.background_named_by]
        self.background = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.randn(width) * embed.weight.std().item()) for name in unnamed})
        self.temperature = torch.nn.Parameter(torch.tensor(10.0))
        self.centre = torch.nn.Linear(width, DENSE_HEADS["centre"])
        outputs = {**STRUCTURED_HEADS, "box_digits": BOX_PLACES * BOX_VALUES, "where": 2}
        if count_heads not in ("linear", "cosine"):
            raise ValueError(f"count_heads is {count_heads!r}: 'linear' or 'cosine'")

        def head(name: str) -> torch.nn.Module:
            if name == "place":
                return PlaceHead(width)
            if name in COUNT_HEADS and count_heads == "cosine":
                return CosineClassHead(width, outputs[name], COUNT_TEMPERATURE)
            return torch.nn.Linear(width, outputs[name])
        self.structured = torch.nn.ModuleDict({name: head(name) for name in self.structured_names if name not in WORD_HEADS})

    @classmethod
    def from_state(cls, model, processor, options: dict, state: dict) -> "NameHeads":
        """The heads a stage 1 with `options` (stage1_options' keys) trained, as a cache saved them."""
        heads = cls(model.get_input_embeddings(), processor.tokenizer, model.config.vision_config.out_hidden_size,
                    structured=options["structured"], motion=options["motion_steps"] > 0,
                    count_heads=options["count_heads"], count_weight=options["count_weight"])
        heads.load_state_dict(state)
        return heads

    @property
    def motion(self) -> bool:
        return "motion" in self.name_ids

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        directions = torch.nn.functional.normalize(tokens, dim=-1)  # (N, D)
        logits = {}
        for name, word_ids in self.name_ids.items():
            # (names [+ 1], D): each name's embedding (averaged over its tokens should the tokenizer split it), then background
            classes = torch.stack([self.embed.weight[ids].mean(0) for ids in word_ids])
            if name in self.background:
                classes = torch.cat([classes, self.background[name][None]])
            logits[name] = self.temperature * directions @ torch.nn.functional.normalize(classes, dim=-1).T  # (N, classes)
        logits["centre"] = self.centre(tokens)
        for name, head in self.structured.items():
            logits[name] = head(tokens)
        if "box_digits" in logits:
            logits["box_digits"] = logits["box_digits"].unflatten(-1, (BOX_PLACES, BOX_VALUES))  # (N, 12, 12)
        return logits


class CosineClassHead(torch.nn.Module):
    """Scores classes as a fixed temperature times the cosine of the token with one learned direction
    per class (COUNT_TEMPERATURE says why), plus a learned bias per class, which can hold the prior
    (most shapes are the only one of their colour) so that the direction need not. It learns at the
    optimizer's pace, though: at temperature 10, by stage-1 step 250 the colour and kind counts
    (65-70% right, below the most common count's 81% and 74%) leant shape tokens 0.24 toward their
    right count's direction with the bias as without it."""

    def __init__(self, width: int, classes: int, temperature: float):
        super().__init__()
        self.directions = torch.nn.Parameter(torch.randn(classes, width))
        self.bias = torch.nn.Parameter(torch.zeros(classes))
        self.temperature = temperature

    def cosines(self, tokens: torch.Tensor) -> torch.Tensor:
        unit = torch.nn.functional.normalize
        return unit(tokens, dim=-1) @ unit(self.directions, dim=-1).T  # (N, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.temperature * self.cosines(tokens) + self.bias


class PlaceHead(torch.nn.Module):
    """Reads x and y as the cosine of the token with two learned directions: a place of 0.5 (the
    image's edge) takes half the token's direction, a typical 0.25 a quarter. A plain linear head can
    grow its weights instead and leave the place a trace in the token: read along a unit direction
    over a name row's norm, the place was 6% of a stage-1 token's norm (tokens are 5.6 times a name
    row's norm, since cosine scoring of the names leaves their norm free), and the language model
    did not learn to read it in 500 steps; over exact tokens, where it was about 30%, it did in 250."""

    def __init__(self, width: int):
        super().__init__()
        self.directions = torch.nn.Parameter(torch.randn(2, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        unit = torch.nn.functional.normalize
        return unit(tokens, dim=-1) @ unit(self.directions, dim=-1).T  # (N, 2)


def vision_validation(processor, structured: tuple[str, ...] = (), motion: bool = False):
    """The fixed images (and labels; clips too with `motion`) stage 1's accuracies are measured on:
    {"seen": validation scenes, "heldout_pairs": the same stills in held-out pairs (`heldout_pair_samples`)}."""
    seeds = list(range(96))
    return {"seen": dense_batch(processor, seeds, split="validation", structured=structured, motion=motion),
            "heldout_pairs": dense_labels(processor, heldout_pair_samples(seeds), structured)}


def vision_probe(visual, heads, validation: dict) -> dict[str, float]:
    """Stage 1's heads on `vision_validation`'s images: kind / colour / background / centre accuracy of
    the merged tokens (and the structured heads'), and kind and colour on the held-out pairs'
    scenes ("kind_heldout_pairs" ...). During stage 1 it is the curve; after stage 2 it shows what the
    VLM's training left of stage 1 (the word rows the heads score against move with the language model)."""
    was_training = visual.training
    visual.eval()
    with torch.no_grad():
        _, accuracy = dense_scores(visual, heads, *validation["seen"])
        _, heldout = dense_scores(visual, heads, *validation["heldout_pairs"], motion=False)
    visual.train(was_training)
    accuracy.update({f"{k}_heldout_pairs": heldout[k] for k in ("kind", "colour")})
    return {k: round(v, 3) for k, v in accuracy.items()}


def loss_weight(heads, name: str) -> float:
    """A stage-1 label's weight in the loss: the heads' count_weight for the cosine count heads, else 1."""
    cosine = name in heads.structured and isinstance(heads.structured[name], CosineClassHead)
    return heads.count_weight if cosine else 1.0


@torch.no_grad()
def right_class_cosine(logits: torch.Tensor, right: torch.Tensor, temperature, bias=0.0) -> float:
    """The mean cosine of tokens with their right class's direction (that class's share of the token's
    direction), read back from cosine-scored logits (N, classes) = temperature x cosine + bias."""
    return ((logits - bias) / temperature).gather(1, right[:, None]).mean().item()


def dense_scores(visual, heads, pixel_values, grid, labels, motion: bool | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Stage 1's loss and accuracies on one batch; `motion` (default: whether the heads have a motion
    head) says whether the labels hold the direction column."""
    motion = heads.motion if motion is None else motion
    tokens = visual(pixel_values, grid).pooler_output  # (N, D): merged tokens, row-major per image
    if tokens.shape[0] != labels.shape[0]:
        raise ValueError(f"the connector gives {tokens.shape[0]} tokens for {labels.shape[0]} image cells; "
                         "vision pretraining needs a spatial connector (merger or mlp)")
    logits = heads(tokens)
    structured = heads.structured_names
    names = label_names(structured, motion)
    column = {name: labels[:, i] for i, name in enumerate(names)}
    # -100 (a clip's structured labels) is cross_entropy's ignore_index
    loss = sum(loss_weight(heads, name) * torch.nn.functional.cross_entropy(logits[name], column[name])
               for name in names if name != "motion")
    if motion:
        # balanced: the moving shape's tokens (about 4% of a batch) weigh as much as all the still ones,
        # or "still everywhere" is a minimum the head does not leave (0-1% on moving tokens at step 750)
        moving = column["motion"] < STILL
        loss = loss + sum(torch.nn.functional.cross_entropy(logits["motion"][part], column["motion"][part])
                          for part in (moving, ~moving) if part.any())
    on_shape = column["kind"] < len(KINDS)
    hits = {name: logits[name].argmax(-1) == column[name] for name in names}
    coloured = on_shape & (column["colour"] >= 0)  # not the off-palette shapes of --recolour-share
    # "background": background cells told from shapes (with background_word, their type named)
    accuracy = {"kind": hits["kind"][on_shape].float().mean().item(), "colour": hits["colour"][coloured].float().mean().item(),
                "background": hits["kind"][~on_shape].float().mean().item(), "centre": hits["centre"].float().mean().item()}
    # the names' share of a shape token's direction: its cosine with its kind's and colour's word rows
    for name, cells in (("kind", on_shape), ("colour", coloured)):
        accuracy[f"{name}_share"] = right_class_cosine(logits[name][cells], column[name][cells], heads.temperature)
    for name in (h for h in STRUCTURED_HEADS if h in structured):  # the scene-wide ones over every cell, the rest over shape cells
        labelled = column[name] >= 0
        cells = labelled if name in ("total", "background_type") else labelled & on_shape
        accuracy[name] = hits[name][cells].float().mean().item()
        head = heads.structured[name]
        if isinstance(head, CosineClassHead):  # the count's share of the token's direction: its cosine with the right count's
            accuracy[f"{name}_share"] = right_class_cosine(logits[name][cells], column[name][cells], head.temperature, head.bias)
    for head in heads.background_named_by:
        accuracy["background_word"] = hits[head][~on_shape].float().mean().item()
    if "size_word" in structured:
        accuracy["size_word"] = hits["size_word"][column["size_word"] >= 0].float().mean().item()
    rest = labels[:, len(names):]  # (N, 12 box digits, then where's x and y, as `structured` has them)
    on_image = rest[:, -1] >= 0 if has_where(structured) else None  # clips' tokens hold -100
    if "box_digits" in structured:
        digits, rest = rest[:, :BOX_PLACES], rest[:, BOX_PLACES:]  # (N, 12)
        loss = loss + torch.nn.functional.cross_entropy(logits["box_digits"].flatten(0, 1), digits.flatten())
        hundreds = (logits["box_digits"].argmax(-1) == digits)[:, ::3]  # (N, 4): each coordinate's hundreds
        accuracy["box_hundreds"] = hundreds[on_shape & (digits[:, 0] >= 0)].float().mean().item()
    if "where" in structured:
        target = rest[on_image].float() / WHERE_SCALE  # (n, 2) x, y in [0, 1]
        error = logits["where"][on_image] - target
        # a uniform coordinate has variance 1/12: times 12, predicting the mean costs 1, as a coin costs ln 2 in a CE
        loss = loss + 12 * error.pow(2).mean()
        accuracy["where"] = (error.abs() < 0.1).all(-1)[on_shape[on_image]].float().mean().item()  # both within a tenth
    if "place" in structured:
        shape = on_shape[on_image]
        target = (rest[on_image].float() / WHERE_SCALE - 0.5) * shape[:, None]  # (n, 2): 0 on background
        error = logits["place"][on_image] - target
        # balanced, like motion: shape tokens (about a third) weigh as much as the background's zeros
        loss = loss + 12 * sum(error[part].pow(2).mean() for part in (shape, ~shape) if part.any())
        accuracy["place"] = (error.abs() < 0.1).all(-1)[shape].float().mean().item()
    if motion:
        accuracy["motion"] = hits["motion"][moving].float().mean().item()  # on the moving shape's tokens
        accuracy["still"] = hits["motion"][~moving].float().mean().item()
    return loss, accuracy


def continued_heads(heads: NameHeads, saved: dict) -> None:
    """Load a stage-1 cache's heads into `heads`, which may have more of them (those start fresh); a head
    the cache has and `heads` lacks, or one of another shape, is an error (stage 1 would drop what it taught)."""
    mine = heads.state_dict()
    dropped = sorted(k for k in saved if k not in mine)
    if dropped:
        raise ValueError(f"the stage-1 cache has heads this run lacks: {', '.join(dropped)}")
    reshaped = [f"{k} {tuple(v.shape)} (this run: {tuple(mine[k].shape)})" for k, v in saved.items() if v.shape != mine[k].shape]
    if reshaped:
        raise ValueError(f"the stage-1 cache's heads differ in shape: {', '.join(reshaped)}")
    heads.load_state_dict(saved, strict=False)


def pretrain_vision(model, processor, steps: int, batch_size: int, lr: float, seed: int, eval_every: int,
                    structured: tuple[str, ...] = (), motion_steps: int = 0, recolour: float = 0.0,
                    recolour_kinds: dict[str, float] | None = None, count_heads: str = "linear", count_weight: float = COUNT_LOSS_WEIGHT,
                    init: dict | None = None) -> tuple[list[dict], NameHeads]:
    """Stage 1: train the vision tower and its merger on per-token scene labels (`structured`: also
    those heads' (STRUCTURED_CHOICES); the last `motion_steps`: clips too, and each token's
    direction; `recolour`: that share of the shapes in off-palette fills, kind labelled only, and
    `recolour_kinds` that of the kinds it names;
    `count_heads`, `count_weight`: NameHeads'); returns the curve (loss, and on fixed validation images (and clips, with
    motion_steps) the kind / colour accuracy on shape tokens, the direction on moving tokens, and the
    structured heads' accuracies) and the heads. With `init` (a stage-1 cache), the model and the heads
    start as it left them (heads it lacks start fresh; `continued_heads`), the images follow its own,
    and the curve's steps count on from its last."""
    motion = motion_steps > 0
    visual = model.model.visual
    heads = NameHeads(model.get_input_embeddings(), processor.tokenizer, model.config.vision_config.out_hidden_size,
                      structured=structured, motion=motion, count_heads=count_heads, count_weight=count_weight)
    first = 0  # the steps already taken: the images and the curve go on after them
    if init is not None:
        model.load_state_dict(init["model"])
        continued_heads(heads, init["heads"])
        first = init["vision_curve"][-1]["step"]  # its last row is its last step, counting its own init's
    params = [*visual.parameters(), *heads.parameters()]  # heads' parameters include the word embeddings
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 10), num_training_steps=steps)
    validation = vision_validation(processor, structured, motion)
    curve, start = [], time.time()
    visual.train()
    for step in range(1, steps + 1):
        seeds = [seed * 10_000_019 + 7_000_000 + (first + step) * batch_size + i for i in range(batch_size)]
        clips = step > steps - motion_steps
        batch = dense_batch(processor, seeds, structured=structured, motion=clips, recolour=recolour,
                            recolour_kinds=recolour_kinds)
        loss, _ = dense_scores(visual, heads, *batch, motion=clips)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        if (eval_every and step % eval_every == 0) or step == steps:  # 0: only the end's row, which the log keeps
            row = {"step": first + step, "minutes": round((time.time() - start) / 60, 2), "loss": round(loss.item(), 4),
                   **vision_probe(visual, heads, validation)}
            curve.append(row)
            print(json.dumps({"vision": row}), flush=True)
    return curve, heads


# ----------------------------------------------------------------------------- stage 2: the VLM


class ShapesStream(IterableDataset):
    """Endless fresh training samples. The first `text_samples` describe the scene in words instead of
    showing it (`as_described_messages`: count, colour and existence on the caption). Then sample i
    of the image part belongs to step i // batch, which sets its curriculum level, and every
    `text_every`-th round of the tasks a describable sample is again given as text (0: never).

    With `existence_group` > 1, the first of every that many existence slots gives that many
    minimal-pair questions about one scene (`existence_questions`), side by side so they share a
    batch, and the others give none: the task mix stays the same. `position_group` does the same for
    position (`position_questions`: each pair of shapes asked both ways); position is never text.
    `count_group` does it for count (`count_questions`: the variants in turn, naming other values).
    A "centre" task slot gives `centre_group` centre questions the same way (`centre_samples`: each
    about another shape, of one scene while it has enough).

    With `followups` > 0, every image sample becomes a conversation: its own question first (as the
    evaluation asks it), then that many more about the same image (`scene_questions`, from the
    tasks of the sample's curriculum level; describable ones when it is given as text).

    With `opening_samples` > 0, that many image samples come between the text samples and the
    curriculum: `opening_tasks` in turn, on full scenes, never as text (what
    examples/probe_ideal_tower.py trains, where colour and existence reach 88-100% on 1-5 shapes).
    The curriculum then runs over `total_samples` as without them. `centre_samples` > 0 puts that
    many centre questions, alone and on full scenes, after the opening (`centre_first`: before it),
    the other phases' samples staying those of a run without them: over exact visual tokens a
    language model learned centre questions alone in 250-500 steps, and position right after, but not
    centre mixed with colour and existence from the start; and in a full run, centre steps before the
    opening slowed its colour and existence; after it, 750 centre steps taught centre and then
    position (test 87%) but wiped the opening's answers, existence never fully relearned
    (benchmarks/results/shapes_experiments.md). `centre_mixed` > 0 makes every other sample of the
    last that many of those steps one of `opening_tasks` instead, in turn: centre alone until learned,
    then the opening's answers relearned beside it."""

    def __init__(self, total_samples: int, seed: int, smoke: bool, tasks: tuple[str, ...] = TASKS,
                 text_samples: int = 0, text_every: int = 0, existence_group: int = 1, followups: int = 0,
                 position_group: int = 1, centre_group: int = 4, count_group: int = 1,
                 opening_samples: int = 0, opening_tasks: tuple[str, ...] = OPENING_TASKS, centre_samples: int = 0,
                 centre_first: bool = False, centre_mixed: int = 0):
        self.total, self.seed, self.smoke, self.tasks = total_samples, seed, smoke, tasks
        self.text_tasks = [t for t in tasks if t in DESCRIBABLE_TASKS]
        self.text_samples = text_samples if self.text_tasks else 0
        self.opening_samples, self.opening_tasks = opening_samples, tuple(opening_tasks)
        self.centre_samples = centre_samples
        self.centre_start = self.text_samples + (0 if centre_first else opening_samples)
        # centre_mixed: in the last that many slots of the centre steps every other slot is an opening
        # task, in turn, so that the opening's answers are kept or relearned while centre is taught
        # (alone, they fall to 0%)
        if not 0 <= centre_mixed <= centre_samples:
            raise ValueError(f"centre_mixed is {centre_mixed} samples, not between 0 and the {centre_samples} centre samples")
        self.centre_alone = centre_samples - centre_mixed
        self.mixed_tasks = tuple(t for opening in self.opening_tasks for t in (CENTRE, opening) if opening != CENTRE)
        check_stream_tasks(tasks, "tasks")
        check_stream_tasks(self.opening_tasks if opening_samples else (), "opening tasks")
        self.text_every, self.existence_group, self.followups = text_every, existence_group, followups
        self.position_group, self.centre_group, self.count_group = position_group, centre_group, count_group

    def difficulty(self, index: int) -> int:
        progress, level = index / max(1, self.total), 0
        for bound in torch.tensor(CURRICULUM_SCHEDULE).cumsum(0).tolist()[:-1]:
            level += progress >= bound
        return min(level, len(CURRICULUM) - 1)

    def options(self, level: int) -> dict:
        return {"difficulty": 0, "max_shapes": 2} if self.smoke else {"difficulty": level}

    def __iter__(self):
        # task -> (questions per group, draw(seed, count, make_sample options) -> that many samples)
        groups = {"existence": (self.existence_group, lambda seed, count, options: existence_questions(
                      make_sample(seed, task="existence", **options), seed, count)),
                  "position": (self.position_group, lambda seed, count, options: position_questions(
                      make_sample(seed, task="position", **options), seed, count)),
                  "count": (self.count_group, lambda seed, count, options: count_questions(
                      make_sample(seed, task="count", **options), seed, count)),
                  CENTRE: (self.centre_group, lambda seed, count, options: centre_samples(seed, count, **options))}
        slots = dict.fromkeys(groups, 0)
        for drawn in itertools.count():
            # every phase but the centre steps sees the index it would without them
            in_centre = self.centre_start <= drawn < self.centre_start + self.centre_samples
            index = drawn - self.centre_samples * (drawn >= self.centre_start + self.centre_samples)
            seed = self.seed * 10_000_019 + index
            if in_centre:
                seed = self.seed * 10_000_019 + 8_000_000 + drawn - self.centre_start  # seeds of their own
                level, as_text, offset = len(CURRICULUM) - 1, False, drawn - self.centre_start
                tasks = (CENTRE,) if offset < self.centre_alone else self.mixed_tasks
                task = tasks[max(0, offset - self.centre_alone) % len(tasks)]
            elif index < self.text_samples:
                # scenes of up to 3 shapes (level 1): enough distractors that matching names is the only way
                task, level, as_text = self.text_tasks[index % len(self.text_tasks)], 1, True
                tasks = self.text_tasks
            elif index < self.text_samples + self.opening_samples:
                i = index - self.text_samples
                seed += 9_000_000  # seeds of its own: the curriculum's samples stay those of a run without it
                tasks, level, as_text = self.opening_tasks, len(CURRICULUM) - 1, False
                task = tasks[i % len(tasks)]
            else:
                i = index - self.text_samples - self.opening_samples
                seed -= self.opening_samples
                level = 0 if self.smoke else self.difficulty(i)
                tasks = [t for t in self.tasks if t in LEVEL_TASKS[level]] or self.tasks
                task = tasks[i % len(tasks)]
                as_text = bool(self.text_every) and task in DESCRIBABLE_TASKS and (i // len(tasks)) % self.text_every == 0
            sample_options = self.options(level)
            group, draw = groups.get(task, (1, None))
            if group > 1:
                slot, slots[task] = slots[task], slots[task] + 1
                if slot % group:
                    continue  # filled by the group that opened at slot - slot % group
                # counted in groups: every group would otherwise fall on a text round
                if not in_centre and index >= self.text_samples + self.opening_samples:  # the curriculum
                    as_text = bool(self.text_every) and task in DESCRIBABLE_TASKS and (slot // group) % self.text_every == 0
                items = draw(seed, group, sample_options)
            elif task in PRECURSORS:  # the tasks' single questions are the plain samples
                items = precursor_samples(task, seed, 1, **sample_options)
            else:
                items = [make_sample(seed, task=task, **sample_options)]
            for item in items:
                to_messages = as_described_messages if as_text else as_messages
                followups = scene_questions(item, seed, self.followups, [t for t in tasks if t in (
                                            DESCRIBABLE_TASKS if as_text else TASKS)])
                yield {"messages": to_messages(item, followups=followups), "fps": item["fps"]}


class LengthSortedSteps(IterableDataset):
    """`stream`'s samples `batch_size` at a time (one optimizer step's), each step's shortest first, for
    --micro-batches: a step's micro-batches then each pad to lengths near their own instead of all to
    the step's longest sample (at the curriculum's last level a batch of 32 is 57% padding: one-word
    answers beside captions and boxes; benchmarks/results/micro_batch_speed.json). The step trains on
    the same samples as without it and, with VLMKitTrainer dividing each micro-batch's mean by the
    micro-batches (`loss_is_scaled_for_ga`), to the same gradient up to rounding.
    Lengths are estimated without processing the pixels: the text's tokens plus the visual tokens of
    the image processor's resize, for a clip per frame pair (its frames padded to whole pairs, as the
    video processor pads them). They leave out the chat template's tokens: a fixed number per sample,
    and for a clip a "<t seconds>" stamp per frame pair, a few tokens, which only sorting can miss."""

    def __init__(self, stream, batch_size: int, processor):
        self.stream, self.batch_size, self.processor = stream, batch_size, processor

    def length(self, sample: dict) -> int:
        images = self.processor.image_processor
        tokens = 0
        for message in sample["messages"]:
            for part in message["content"]:
                if part["type"] == "text":
                    tokens += len(self.processor.tokenizer(part["text"])["input_ids"])
                elif part["type"] in ("image", "video"):
                    frames = part["video"] if part["type"] == "video" else [part["image"]]
                    height, width = np.asarray(frames[0]).shape[:2]
                    steps_in_time = math.ceil(len(frames) / images.temporal_patch_size)
                    tokens += images.get_number_of_image_patches(height, width) // images.merge_size**2 * steps_in_time
        return tokens

    def __iter__(self):
        samples = iter(self.stream)
        while step := list(itertools.islice(samples, self.batch_size)):
            yield from sorted(step, key=self.length)


def exact_match(model, collator, samples: list[dict], to_messages=as_messages) -> torch.Tensor:
    """(N,) bool: the answer (and its <|im_end|>) is each position's top token under teacher forcing,
    which is what greedy decoding would produce. `to_messages` turns a sample into its chat
    (as_described_messages: the caption in place of the image)."""
    batch = collator([{"messages": to_messages(s), "fps": s["fps"]} for s in samples])
    labels = batch.pop("labels")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        predicted = model(**batch).logits[:, :-1].argmax(-1)
    model.train(was_training)
    targets = labels[:, 1:]
    return ((predicted == targets) | (targets == IGNORE_INDEX)).all(dim=1)


def exact_match_batched(model, collator, samples: list[dict], to_messages=as_messages, batch_size: int = 32) -> torch.Tensor:
    """(N,) bool: exact_match over `samples` in batches of `batch_size` (the padded logits of a whole
    validation set at once would take gigabytes)."""
    return torch.cat([exact_match(model, collator, samples[i:i + batch_size], to_messages)
                      for i in range(0, len(samples), batch_size)])


class CurveLogger(TrainerCallback):
    """Loss at every log; every `eval_every` steps, exact match per task on fixed validation
    questions (full difficulty) with their image and with a blank one."""

    def __init__(self, collator, tasks: tuple[str, ...], eval_every: int, per_task: int = 16):
        self.curve, self.evals, self.start = [], [], time.time()
        self.collator, self.eval_every = collator, eval_every
        self.samples = [precursor_samples(task, i, 1, split="validation")[0] if task in PRECURSORS else
                        make_sample(i, task=task, split="validation")
                        for task in dict.fromkeys(tasks) for i in range(per_task)]  # a task listed twice: once
        self.blank_samples = [blank_like(s) for s in self.samples]

    def restarted(self) -> "CurveLogger":
        """A logger with a curve and a clock of its own over the same validation questions (the polish's)."""
        fresh = copy.copy(self)
        fresh.curve, fresh.evals, fresh.start = [], [], time.time()
        return fresh

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.curve.append({"step": state.global_step, "loss": round(logs["loss"], 4),
                               "minutes": round((time.time() - self.start) / 60, 2)})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.eval_every and (state.global_step % self.eval_every == 0 or state.global_step == state.max_steps):
            row = {"step": state.global_step, "minutes": round((time.time() - self.start) / 60, 2)}
            for name, samples in (("image", self.samples), ("blank", self.blank_samples)):
                correct = exact_match_batched(model, self.collator, samples)
                for task in dict.fromkeys(s["task"] for s in samples):
                    hits = [c for c, s in zip(correct.tolist(), samples) if s["task"] == task]
                    row[f"{task}/{name}"] = round(sum(hits) / len(hits), 3)
            self.evals.append(row)
            print(json.dumps(row), flush=True)


class OpeningCheck(TrainerCallback):
    """At stage 2's step `at_step` (the opening's end), existence's exact-match rate on `per_task`
    validation questions with their images; below `bar`, the run stops there (`failed`).

    Why existence, and why there: over one stage 1, whether the opening learns existence depends on
    the draw of its samples, and a curriculum after an opening that missed it never makes it up. Of
    the full runs in benchmarks/results with the shipped order (opening, centre steps, curriculum,
    polish), the five whose opening ended at 88-100% on existence (16 validation questions) reached
    87-91% on the test split, the one that ended at 56% 76%. Session 34's run with --opening-bar 0.7:
    seed 0's opening 55% on 64 questions, so stage 2 restarted; seed 1's 81%, test existence 88%."""

    def __init__(self, collator, at_step: int, bar: float, per_task: int = 64):
        self.collator, self.at_step, self.bar = collator, at_step, bar
        self.samples = [make_sample(i, task="existence", split="validation") for i in range(per_task)]
        self.score = None

    @property
    def failed(self) -> bool:
        return self.score is not None and self.score < self.bar

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at_step:
            self.score = exact_match_batched(model, self.collator, self.samples).float().mean().item()
            print(json.dumps({"opening_check": {"step": self.at_step, "existence": round(self.score, 3),
                                                "questions": len(self.samples), "bar": self.bar}}), flush=True)
            control.should_training_stop = self.failed


PATCH_EMBED_WEIGHT = "model.visual.patch_embed.proj.weight"


def learn_frame_difference_only(weight: torch.nn.Parameter) -> None:
    """Let a Conv3d patch embedding's weight (D, C, 2, p, p) learn only what tells a patch's two
    frames apart: its gradient keeps its antisymmetric part (h, -h), h = (g0 - g1) / 2. A still image
    repeats its frame over the temporal patch, so it sees only w0 + w1, which then stays as it was.
    Built by negation, so that it is exact in floating point: Adam's update of (h, -h) is then exactly
    (u, -u) too (it would turn the rounding noise of g - mean(g) into full-size steps of one sign),
    as long as the group has no weight decay."""
    if weight.shape[2] != 2:
        raise ValueError(f"frame-difference training needs a temporal patch of 2 frames, got {weight.shape[2]}")

    def antisymmetric(grad: torch.Tensor) -> torch.Tensor:
        half = (grad[:, :, :1] - grad[:, :, 1:]) / 2  # (D, C, 1, p, p)
        return torch.cat([half, -half], dim=2)

    weight.register_hook(antisymmetric)


def stage_2_param_groups(model, lr: float, vision_lr_scale: float, deepstack_lr_scale: float,
                         frame_difference_lr_scale: float = 0.0) -> list[dict]:
    """Optimizer groups for stage 2: the language model at lr, the vision tower and its merger at
    lr * vision_lr_scale, the DeepStack mergers at lr * deepstack_lr_scale. A scale of 0 freezes its
    parameters (requires_grad off, so no backward pass reaches them at all, not just no update).
    With frame_difference_lr_scale > 0, the patch embedding's weight leaves the tower's group for one
    of its own at lr * that scale, without weight decay, learning only the frame-difference part
    (`learn_frame_difference_only`): over a frozen tower, clips can then change how they embed while
    every still image's tokens stay exactly those stage 1 taught.

    Stage 1 never trains the DeepStack mergers (their outputs feed only the decoder), so over a
    frozen stage-1 tower they would add fixed random projections to the first layers' visual
    positions; examples/probe_ideal_tower.py --tower stage1 trains them at the full rate."""
    def part(name: str) -> str:
        if not name.startswith("model.visual."):
            return "text"
        if name == PATCH_EMBED_WEIGHT and frame_difference_lr_scale:
            return "frame_difference"
        return "deepstack" if ".deepstack_merger_list." in name else "tower"

    scales = {"text": 1.0, "tower": vision_lr_scale, "deepstack": deepstack_lr_scale,
              "frame_difference": frame_difference_lr_scale}
    params: dict[str, list] = {key: [] for key in scales}
    for name, param in model.named_parameters():
        params[part(name)].append(param)
    groups = []
    for key, scale in scales.items():
        if scale == 0:
            for param in params[key]:
                param.requires_grad_(False)
        elif params[key]:
            # no decay on the frame-difference part: it would shrink the part stills see
            groups.append({"params": params[key], "lr": lr * scale} | ({"weight_decay": 0.0} if key == "frame_difference" else {}))
    if frame_difference_lr_scale:
        learn_frame_difference_only(model.get_parameter(PATCH_EMBED_WEIGHT))
    return groups


def train_language_model(model, collator, stream, args, steps: int, lr: float, warmup: int, schedule: str,
                         *callbacks) -> None:
    """Stage 2 (and the polish after it): `steps` steps of Trainer over `stream`, the tower's and the
    mergers' learning rates scaled as `stage_2_param_groups` says, a fresh AdamW; each step in
    `args.micro_batches` length-sorted micro-batches (`LengthSortedSteps`)."""
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="train-shapes-"), max_steps=steps,
        per_device_train_batch_size=args.batch_size // args.micro_batches, gradient_accumulation_steps=args.micro_batches,
        learning_rate=lr, warmup_steps=warmup, lr_scheduler_type=schedule, weight_decay=0.01,
        logging_steps=max(1, steps // 100), save_strategy="no", report_to=[], use_cpu=True,
        remove_unused_columns=False, dataloader_num_workers=0, seed=args.seed, max_grad_norm=1.0,
        # accelerate's batch dispatcher (its default for iterable datasets) slices every tensor to the
        # batch size, which would cut pixel_values: (patches of all images, C*T*P*P) has no batch dim
        accelerator_config={"dispatch_batches": False},
    )
    optimizer = torch.optim.AdamW(stage_2_param_groups(model, lr, args.vision_lr_scale, args.deepstack_lr_scale,
                                                       args.frame_difference_lr_scale),
                                  lr=lr, weight_decay=0.01, betas=(0.9, args.adam_beta2))
    # VLMKitTrainer: the per-sample losses are per-micro-batch means, which it divides by the micro-batches
    trainer = VLMKitTrainer(model=model, args=training_args, data_collator=collator, optimizers=(optimizer, None),
                            compute_loss_func=LOSS_FUNCTIONS[args.loss],
                            train_dataset=LengthSortedSteps(stream, args.batch_size, collator.processor)
                            if args.micro_batches > 1 else stream, callbacks=list(callbacks))
    trainer.train()


class ColourWordSwap:
    """A collator whose batches read, at a `share` of the answers' colour words right before a kind
    (" red" in "a small red star"), another palette colour, drawn uniformly, in the input only: the
    labels keep the true colour, so the model still learns to write it, but the kind after it has to
    come from the image. Without it, a caption's kind follows the colour word it has just written: the
    model shipped before session 53, given a held-out colour-kind pair's own colour word, wrote that
    kind in 0% of one-shape scenes, and 35% after a seen pair's colour word (probe_question_use.py,
    caption_kind_after_colour); trained with the swaps, the shipped model writes it in 45%. Each
    palette colour must be one token after a space.

    With `max_pairs` > 0, only rows whose answers name at most that many colour-kind pairs (captions
    of at most that many shapes) are swapped: the swaps cost seen pairs' kinds 9-13 points in captions
    of 2-5 shapes but 3 in one-shape captions (session 52). Tried with 1 (session 53), it gave the seen
    pairs' kinds back and lost most of the held-out pairs' (15% against 38% in scenes of 2-5 shapes)."""

    def __init__(self, collator, share: float, seed: int, max_pairs: int = 0):
        tokenizer = collator.processor.tokenizer
        pieces = dict(zip(COLOURS, name_token_ids(tokenizer, COLOURS)))
        if split := {colour: ids for colour, ids in pieces.items() if len(ids) != 1}:
            raise ValueError("colour-word swaps need one token per colour; the tokenizer splits "
                             + ", ".join(f'" {colour}" into {len(ids)}' for colour, ids in split.items()))
        # processor too: with micro-batches, train_language_model sorts steps by length with collator.processor
        self.collator, self.processor, self.share, self.max_pairs = collator, collator.processor, share, max_pairs
        self.colour_ids = torch.tensor([ids[0] for ids in pieces.values()])
        self.kind_ids = torch.tensor(sorted({ids[0] for ids in name_token_ids(tokenizer, KINDS)}))
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, rows) -> dict[str, torch.Tensor]:
        batch = self.collator(rows)
        labels, input_ids = batch["labels"], batch["input_ids"].clone()
        # (B, L-1): a learned colour word whose next learned token is a kind's first
        before_kind = torch.isin(labels[:, :-1], self.colour_ids) & torch.isin(labels[:, 1:], self.kind_ids)
        if self.max_pairs:
            before_kind &= before_kind.sum(1, keepdim=True) <= self.max_pairs
        swapped = torch.zeros_like(labels, dtype=torch.bool)
        swapped[:, :-1] = before_kind & (torch.rand(before_kind.shape, generator=self.generator) < self.share)
        # another colour: the true one's index plus 1 to n-1, modulo n
        n = len(self.colour_ids)
        index = (input_ids[swapped][:, None] == self.colour_ids).int().argmax(-1)
        shift = torch.randint(1, n, index.shape, generator=self.generator)
        input_ids[swapped] = self.colour_ids[(index + shift) % n]
        batch["input_ids"] = input_ids
        return batch


# --stage1-cache: the options that shape stage 1, which a cached one must match; a cache saved before an
# option was recorded ran at that option's default
STAGE1_DEFAULTS = {"structured": (), "motion_steps": 0, "recolour_share": 0.0, "recolour_kinds": "", "seed": 0, "count_heads": "linear",
                   "count_weight": COUNT_LOSS_WEIGHT, "init": None}


def machine() -> dict:
    """The CPU this run (not the caches it loaded) ran on: its minutes depend on it. The same recipe ran
    92 min on a 2-core Intel Xeon and 88 on a Zen 4; its stage 1 took 1.65 times the Intel's on a Zen 3 (AVX2 only)."""
    cpuinfo = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                cpuinfo.setdefault(key.strip(), value.strip())  # the first core's
    return {"cpu": cpuinfo.get("model name") or platform.processor(), "cpu_family": cpuinfo.get("cpu family"),
            "cpu_model": cpuinfo.get("model"), "avx512": "avx512f" in cpuinfo.get("flags", "").split(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def stage1_options(args, structured: tuple[str, ...], vocab: int) -> dict:
    """This run's stage-1 options, as a cache records them."""
    return {"vision_steps": args.vision_steps, "vocab": vocab, "structured": structured, "motion_steps": args.motion_steps,
            "recolour_share": args.recolour_share, "recolour_kinds": args.recolour_kinds, "seed": args.seed, "count_heads": args.count_heads,
            "count_weight": args.count_weight, "init": args.stage1_init}


def cached_stage1_options(cached: dict) -> dict:
    """The stage-1 options a cache holds (stage1_options' keys; the vocabulary read off its embeddings)."""
    held = {"vision_steps": cached["vision_steps"], "vocab": len(cached["model"]["model.language_model.embed_tokens.weight"]),
            **{name: cached.get(name, default) for name, default in STAGE1_DEFAULTS.items()}}
    held["structured"] = tuple(held["structured"])
    return held


def option_differences(held: dict, wanted: dict) -> str:
    """Where a cache's options differ from this run's: "seed 0 (this run: 1), ..."."""
    def shown(value):
        return (",".join(value) or "none") if isinstance(value, tuple) else value
    return ", ".join(f"{name} {shown(held.get(name))} (this run: {shown(wanted[name])})"
                     for name in wanted if held.get(name) != wanted[name])


# --stage2-cache: every option shapes stages 1 and 2 except these, which only the polish, the files or
# the caches themselves read; so a cache matches a run that differs from it in the polish alone
POLISH_ONLY_OPTIONS = ("out", "polish_steps", "polish_lr", "polish_tasks", "polish_colour_swap", "polish_colour_swap_max_shapes",
                       "polish_seed", "stage1_cache", "stage2_cache")


def stage2_options(args) -> dict:
    """This run's options for stages 1 and 2, as a --stage2-cache records them."""
    return {name: value for name, value in sorted(vars(args).items()) if name not in POLISH_ONLY_OPTIONS}


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the shipped model's recipe."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1500, help="curriculum steps, after the opening")
    parser.add_argument("--batch-size", type=int, default=32, help="samples (conversations, with --followups) per step")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="stage 2 and the polish: split each step's batch into this many micro-batches, "
                             "its samples sorted by length, so that short answers do not pad to captions' length "
                             "(the same samples and gradient; benchmarks/micro_batch_speed.py)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--adam-beta2", type=float, default=0.95)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--loss", default="sample", choices=list(LOSS_FUNCTIONS),
                        help="weigh samples equally (per_sample_loss), answers (per_answer_loss: each turn of "
                             "a conversation) or tokens (the model's own loss)")
    parser.add_argument("--eval-every", type=int, default=250,
                        help="steps between validation probes (0: none, but stage 1 still probes its last step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", default=",".join(CURRICULUM_TASKS),
                        help="comma-separated ShapesWorld tasks to train on, and precursors (PRECURSORS: centre, of position; "
                             "background, size and kind, of captions), "
                             "in turn: a task listed twice gets twice the slots")
    parser.add_argument("--vision-lr-scale", type=float, default=0.0,
                        help="stage 2 learning rate of the vision tower and connector, as a multiple of --lr "
                             "(0: frozen, so the VLM's gradients do not wash out the kinds stage 1 taught)")
    parser.add_argument("--deepstack-lr-scale", type=float, default=1.0,
                        help="stage 2 learning rate of the DeepStack mergers, as a multiple of --lr (stage 1 never "
                             "trains them, so they learn here, also over a frozen tower)")
    parser.add_argument("--frame-difference-lr-scale", type=float, default=0.0,
                        help="stage 2 learning rate of the frame-difference part of the patch embedding, as a "
                             "multiple of --lr (0: frozen with the tower): clips embed anew, stills exactly as before")
    parser.add_argument("--vision-steps", type=int, default=5000,
                        help="stage 1: steps of dense per-token supervision of the vision tower (0: skip); "
                             "5000 take 20 min on a Zen 4 CPU (about 2.8 times as long on a Zen 1) and reach 83%% kind accuracy "
                             "on shape tokens")
    parser.add_argument("--vision-lr", type=float, default=5e-4, help="stage 1 learning rate")
    parser.add_argument("--structured-heads", default="place",
                        help="stage 1 also teaches every token these (comma-separated; STRUCTURED_CHOICES or the groups "
                             "count, layout, all): the scene's counts, its shape's size, left-to-right rank and box "
                             "digits, the background, where the cell is; background_word (by the kind head), "
                             "background_word_colour (by the colour head) and size_word score the "
                             "background type and the shape's size against their words")
    parser.add_argument("--count-heads", default="linear", choices=["linear", "cosine"],
                        help="how stage 1 reads --structured-heads' counts (total, colour_count, kind_count): a linear "
                             "head, or the cosine with a learned direction per count at a fixed temperature, which "
                             "makes them a share of every token's direction (COUNT_TEMPERATURE)")
    parser.add_argument("--count-weight", type=float,
                        help="with --count-heads cosine, each count's loss against a name's (default COUNT_LOSS_WEIGHT, "
                             "1/3: the three counts together weigh one name)")
    parser.add_argument("--motion-steps", type=int, default=2250,
                        help="stage 1's last this many steps also show clips (one sample in seven) and teach every "
                             "token which way its shape moves, scored against the direction words (0: stills only)")
    parser.add_argument("--vision-batch-size", type=int, default=32, help="stage 1 images per step")
    parser.add_argument("--recolour-share", type=float, default=0.5,
                        help="stage 1 draws this share of the shapes in fills outside the palette (greys, limes, "
                             "teals, magentas), labelled with their kind only, so kinds are learned apart from colours")
    parser.add_argument("--recolour-kinds", default="",
                        help="KIND=SHARE,...: another --recolour-share for these kinds (the tower tells circles from "
                             "hexagons by colour where it can: examples/probe_tower_shapes.py)")
    parser.add_argument("--text-steps", type=int, default=0,
                        help="stage 2 opens with this many steps of described scenes (text only) before any image")
    parser.add_argument("--text-every", type=int, default=0,
                        help="after them, one round of the tasks in this many gives describable samples as text (0: never)")
    parser.add_argument("--opening-steps", type=int, default=1500,
                        help="after the text steps, this many steps of --opening-tasks on full scenes, before the "
                             "curriculum (probe_ideal_tower.py's mix)")
    parser.add_argument("--centre-steps", type=int, default=750,
                        help="after the opening, before the curriculum, this many steps of centre questions alone "
                             "(one shape's place relative to the image's centre: a precursor of position)")
    parser.add_argument("--centre-first", action="store_true",
                        help="the centre steps before the opening instead (after the text steps)")
    parser.add_argument("--centre-mixed", action="store_true",
                        help="the centre steps keep --opening-tasks in the batch: every other slot one of them, in turn")
    parser.add_argument("--centre-mixed-steps", type=int, default=0,
                        help="only the last this many of the --centre-steps are mixed as --centre-mixed does (the "
                             "first ones centre alone): the opening's answers relearned once centre is learned")
    parser.add_argument("--opening-bar", type=float,
                        help="at the opening's end, existence's exact-match rate on 64 validation questions must reach "
                             "this share, or stage 2 starts over from stage 1's weights on the next seed's samples "
                             "(OpeningCheck; 0: no check; default 0.7, and 0 with --smoke, whose 2-step opening "
                             "cannot reach it)")
    parser.add_argument("--opening-tries", type=int, default=2,
                        help="with --opening-bar: this many openings in all, then the run stops with an error "
                             "(and --out holds only failed_openings.json: each check, its curve, stage 1's curve)")
    parser.add_argument("--opening-tasks", default=",".join(OPENING_TASKS),
                        help="comma-separated tasks of the opening steps, in turn")
    parser.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant_with_warmup"])
    parser.add_argument("--existence-group", type=int, default=8,
                        help="existence comes as this many questions about one scene side by side, half naming a "
                             "shape in it and half one word off one (minimal pairs; 1: one question per scene)")
    parser.add_argument("--position-group", type=int, default=8,
                        help="position comes as this many questions about one scene side by side, each pair of "
                             "shapes asked both ways (minimal pairs; 1: one question per scene)")
    parser.add_argument("--count-group", type=int, default=1,
                        help="count comes as this many questions about one scene side by side, the variants in "
                             "turn, naming colours and kinds it shows and any (count_questions; 1: one per scene)")
    parser.add_argument("--centre-group", type=int, default=4,
                        help="with centre in --tasks or --opening-tasks: this many centre questions side by side, each "
                             "about another shape of one scene while it has enough")
    parser.add_argument("--followups", type=int, default=0,
                        help="each image sample is a conversation: its question, then this many more about the "
                             "same image (scene_questions; 0: one question per sample)")
    parser.add_argument("--stage1-cache", help="load stage 1's model from this file if it exists, else run stage 1 and "
                                                 "save it there (for stage-2 variants over one stage 1)")
    parser.add_argument("--stage1-init", metavar="CACHE",
                        help="stage 1 goes on from this --stage1-cache file: its tower, merger and heads (heads added "
                             "by --structured-heads start fresh), then --vision-steps more steps on the images after "
                             "its own (with --vision-lr's warm-up and cosine anew); the run's stage 1 counts its minutes")
    parser.add_argument("--word-tokenizer", action="store_true",
                        help="a BPE of up to 1024 tokens that learns the role names too, digits split: "
                             "\"user\", \"assistant\" and the seven tasks' answer words one token each (the "
                             "default 512 spells \"assistant\" in 8 pieces and \"purple\" in 2), questions about "
                             "15%% shorter")
    parser.add_argument("--polish-steps", type=int, default=2500,
                        help="after stage 2, this many steps of --polish-tasks in turn on full scenes, at --polish-lr "
                             "(cosine, a fresh optimizer): what the curriculum's last tasks crowded out, relearned")
    parser.add_argument("--polish-lr", type=float, default=2e-4)
    parser.add_argument("--polish-tasks", default=",".join(POLISH_TASKS))
    parser.add_argument("--polish-colour-swap", type=float, default=1.0,
                        help="in the polish, this share of the answers' colour words before a kind read another "
                             "palette colour in the input (the labels keep the true one): the kind then has to come "
                             "from the image (ColourWordSwap)")
    parser.add_argument("--polish-colour-swap-max-shapes", type=int, default=0,
                        help="swap only in captions of at most this many shapes (rows whose answers name at most "
                             "this many colour-kind pairs; 0: every caption)")
    parser.add_argument("--polish-seed", type=int, default=None,
                        help="the polish's scenes and colour swaps (default: stage 2's seed + 1); another seed over "
                             "the same --stage2-cache measures how far two polishes of one recipe differ")
    parser.add_argument("--stage2-cache", help="load the model as stages 1 and 2 left it (before the polish) from this "
                                                 "file if it exists, else run them and save it there (for polish variants "
                                                 "over one stage 2; every option but the polish's must match)")
    parser.add_argument("--init-from", help="start from the model and processor a run saved in this folder: stages 1 "
                                            "and 2 skipped, only the --polish-steps run")
    parser.add_argument("--smoke", action="store_true", help="20 steps of a tiny model (the CI check)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    polish_tasks = tuple(args.polish_tasks.split(","))
    if args.init_from and not args.polish_steps:
        parser.error("--init-from skips stages 1 and 2: give --polish-steps too, or there is nothing to train")
    try:  # before stage 1, not an hour later when the streams are built
        for flag in ("--tasks", "--opening-tasks", "--polish-tasks"):
            check_stream_tasks(getattr(args, flag[2:].replace("-", "_")).split(","), flag)
    except ValueError as error:
        parser.error(str(error))
    structured = structured_heads(args.structured_heads)
    if not 0 <= args.recolour_share <= 1:
        parser.error(f"--recolour-share is {args.recolour_share}, not a share between 0 and 1")
    try:
        recolour_kinds = kind_shares(args.recolour_kinds)
    except ValueError as error:
        parser.error(f"--recolour-kinds: {error}")
    if not 0 <= args.polish_colour_swap <= 1:
        parser.error(f"--polish-colour-swap is {args.polish_colour_swap}, not a share between 0 and 1")
    if args.polish_colour_swap_max_shapes < 0 or (args.polish_colour_swap_max_shapes and not args.polish_colour_swap):
        parser.error(f"--polish-colour-swap-max-shapes is {args.polish_colour_swap_max_shapes}: it needs a "
                     "--polish-colour-swap share above 0, and 0 or more shapes")
    if args.centre_mixed and args.centre_mixed_steps:
        parser.error("--centre-mixed mixes all the centre steps; give it or --centre-mixed-steps, not both")
    if not 0 <= args.centre_mixed_steps <= args.centre_steps:
        parser.error(f"--centre-mixed-steps is {args.centre_mixed_steps}, not between 0 and --centre-steps ({args.centre_steps})")
    if args.opening_bar is None:
        args.opening_bar = 0.0 if args.smoke else 0.7
    if not 0 <= args.opening_bar <= 1:
        parser.error(f"--opening-bar is {args.opening_bar}, not a share between 0 and 1")
    if args.count_heads == "cosine" and not set(COUNT_HEADS) & set(structured):
        parser.error(f"--count-heads cosine reads the counts ({', '.join(COUNT_HEADS)}), and --structured-heads "
                     f"{args.structured_heads} has none: add count")
    if args.count_weight is not None and args.count_heads != "cosine":
        parser.error(f"--count-weight {args.count_weight} weighs the cosine count heads: add --count-heads cosine")
    if args.count_weight is None:
        args.count_weight = COUNT_LOSS_WEIGHT
    if args.stage1_init and (args.init_from or not args.vision_steps):
        parser.error(f"--stage1-init {args.stage1_init} goes on with stage 1: give --vision-steps and no --init-from")
    if args.stage1_init and not os.path.exists(args.stage1_init):
        parser.error(f"--stage1-init {args.stage1_init}: no such file")
    if args.stage2_cache and args.init_from:
        parser.error(f"--init-from skips stages 1 and 2, so --stage2-cache {args.stage2_cache} has nothing to save or load")
    if args.opening_tries < 1:
        parser.error(f"--opening-tries is {args.opening_tries}: at least 1")
    if args.smoke:
        args.steps, args.batch_size, args.vision_batch_size, args.warmup, args.eval_every = 20, 4, 4, 2, 10
        args.vision_steps, args.text_steps, args.opening_steps = 10, 4, 2  # the smoke run checks every stage
        args.motion_steps = min(args.motion_steps, 5)  # half of stage 1, so both halves run
        args.centre_steps, args.polish_steps = min(args.centre_steps, 2), min(args.polish_steps, 3)
        args.centre_mixed_steps = min(args.centre_mixed_steps, args.centre_steps)
    if args.micro_batches < 1 or args.batch_size % args.micro_batches:
        parser.error(f"--micro-batches {args.micro_batches} does not split --batch-size {args.batch_size} "
                     "into equal micro-batches")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    start = time.time()
    if args.init_from:
        model = vlmkit.VLMKitForConditionalGeneration.from_pretrained(args.init_from, dtype=torch.float32)
        processor = vlmkit.VLMKitProcessor.from_pretrained(args.init_from)
        args.vision_steps = args.text_steps = args.centre_steps = args.opening_steps = args.steps = 0
        print(f"loaded {args.init_from}: only the polish steps run")
    else:
        tokenizer = shapes_tokenizer(args.smoke, args.word_tokenizer)
        model, processor = build_model_and_processor(tokenizer, args.smoke)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(processor.tokenizer)}")

    def cached_heads(state: dict | None) -> NameHeads | None:
        """Stage 1's heads, as a cache saved them (for the probe after stage 2)."""
        options = stage1_options(args, structured, model.config.text_config.vocab_size)
        return None if state is None else NameHeads.from_state(model, processor, options, state)

    vision_curve, heads, vision_minutes = [], None, 0.0
    stage_2_cached = torch.load(args.stage2_cache) if args.stage2_cache and os.path.exists(args.stage2_cache) else None
    if stage_2_cached is not None:
        # polish variants over the same stages 1 and 2 need not repeat them; the model is as they left it
        # (float32), so the polish that follows is the one a single run would have trained
        if stage_2_cached["options"] != stage2_options(args):
            raise ValueError(f"{args.stage2_cache} holds other stages 1 and 2 than this run's: "
                             f"{option_differences(stage_2_cached['options'], stage2_options(args))}")
        model.load_state_dict(stage_2_cached["model"])
        heads = cached_heads(stage_2_cached["heads"])
        vision_curve, vision_minutes = stage_2_cached["vision_curve"], stage_2_cached["stage1_minutes"]
        print(f"stages 1 and 2: loaded from {args.stage2_cache} ({stage_2_cached['minutes']:.1f} min when they ran)")
    from_cache = bool(stage_2_cached is None and args.vision_steps and args.stage1_cache and os.path.exists(args.stage1_cache))

    def minutes_so_far() -> float:
        """This run's minutes, a cached stage 1's or stages 1 and 2's included: they count against the budget."""
        earlier = vision_minutes if from_cache else stage_2_cached["minutes"] if stage_2_cached is not None else 0.0
        return (time.time() - start) / 60 + earlier

    if from_cache:
        # variants of stage 2 over the same stage 1 (same seed and stage-1 options) need not repeat it
        cached = torch.load(args.stage1_cache)
        wanted = stage1_options(args, structured, model.config.text_config.vocab_size)
        held = cached_stage1_options(cached)
        if held != wanted:
            raise ValueError(f"{args.stage1_cache} holds another stage 1 than this run's: {option_differences(held, wanted)}")
        model.load_state_dict(cached["model"])
        heads = cached_heads(cached["heads"])
        vision_curve, vision_minutes = cached["vision_curve"], cached["minutes"]
        print(f"stage 1 (vision): loaded from {args.stage1_cache} ({vision_minutes:.1f} min when it ran)")
    elif args.vision_steps and stage_2_cached is None:
        vision_start = time.time()
        init = torch.load(args.stage1_init) if args.stage1_init else None
        vision_curve, heads = pretrain_vision(model, processor, args.vision_steps, args.vision_batch_size, args.vision_lr, args.seed,
                                       eval_every=args.eval_every, structured=structured,
                                       motion_steps=args.motion_steps, recolour=args.recolour_share,
                                       recolour_kinds=recolour_kinds,
                                       count_heads=args.count_heads, count_weight=args.count_weight, init=init)
        vision_minutes = (time.time() - vision_start) / 60
        print(f"stage 1 (vision): {args.vision_steps} steps in {vision_minutes:.1f} min")
        if init is not None:  # the run's stage 1 is the cache's and these steps together
            vision_curve, vision_minutes = init["vision_curve"] + vision_curve, init["minutes"] + vision_minutes
        if args.stage1_cache:
            torch.save({"model": model.state_dict(), "heads": heads.state_dict(), "vision_curve": vision_curve,
                        **stage1_options(args, structured, model.config.text_config.vocab_size), "minutes": vision_minutes},
                       args.stage1_cache)

    tasks = tuple(args.tasks.split(","))
    collator = VLMKitDataCollator(processor)
    model.config.use_cache = False
    curve = CurveLogger(collator, tasks, args.eval_every, per_task=2 if args.smoke else 16)
    groups = dict(existence_group=args.existence_group, position_group=args.position_group, centre_group=args.centre_group,
                  count_group=args.count_group)
    stage_2_seed, opening_checks = args.seed, []
    if stage_2_cached is not None:
        curve.curve, curve.evals = stage_2_cached["curve"], stage_2_cached["evals"]
        stage_2_seed, opening_checks = stage_2_cached["stage_2_seed"], stage_2_cached["opening_checks"]
    elif not args.init_from:
        checked = bool(args.opening_bar and args.opening_steps)
        after_stage_1 = copy.deepcopy(model.state_dict()) if checked else None
        opening_end = args.text_steps + args.opening_steps + (args.centre_steps if args.centre_first else 0)
        for attempt in range(args.opening_tries if checked else 1):
            # another try: stage 2 again from stage 1's weights, on the next seed's samples
            stage_2_seed = args.seed + attempt
            if attempt:
                model.load_state_dict(after_stage_1)
                curve = curve.restarted()
            stage_2 = ShapesStream(args.steps * args.batch_size, stage_2_seed, args.smoke, tasks,
                                   text_samples=args.text_steps * args.batch_size, text_every=args.text_every,
                                   followups=args.followups, **groups,
                                   opening_samples=args.opening_steps * args.batch_size,
                                   opening_tasks=tuple(args.opening_tasks.split(",")),
                                   centre_samples=args.centre_steps * args.batch_size,
                                   centre_first=args.centre_first,
                                   centre_mixed=(args.centre_steps if args.centre_mixed else args.centre_mixed_steps) * args.batch_size)
            check = OpeningCheck(collator, opening_end, args.opening_bar, per_task=8 if args.smoke else 64) if checked else None
            stage_2_steps = args.text_steps + args.centre_steps + args.opening_steps + args.steps
            if stage_2_steps:  # none: stage 1 alone, e.g. to probe a cached stage 1 (vision_after_stage_2 is then its probe)
                train_language_model(model, collator, stage_2, args, stage_2_steps,
                                     args.lr, args.warmup, args.lr_schedule, curve, *([check] if checked else []))
            if check is not None:
                opening_checks.append({"seed": stage_2_seed, "existence": round(check.score, 3),
                                       "minutes": round((time.time() - start) / 60, 1),
                                       **({"evals": curve.evals} if check.failed else {})})  # the last try's are the run's
            if check is None or not check.failed:
                break
        else:
            # no model to save, but what the tries measured is kept (not only in the output) for the record
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "failed_openings.json"), "w") as handle:
                json.dump({"options": vars(args), "opening_checks": opening_checks, "vision_curve": vision_curve,
                           "minutes": round(minutes_so_far(), 1), "machine": machine()}, handle, indent=1, default=str)
            raise SystemExit(f"stage 2's opening missed existence in all {args.opening_tries} tries: at step {opening_end}, "
                             + ", ".join(f"{c['existence']:.0%} (seed {c['seed']})" for c in opening_checks)
                             + f" of {len(check.samples)} validation questions right, below --opening-bar "
                             f"{args.opening_bar:.0%}; try another --seed, or more --opening-tries")
        if args.stage2_cache:
            torch.save({"options": stage2_options(args), "model": model.state_dict(),
                        "heads": heads.state_dict() if heads is not None else None, "vision_curve": vision_curve,
                        "stage1_minutes": vision_minutes, "curve": curve.curve, "evals": curve.evals,
                        "stage_2_seed": stage_2_seed, "opening_checks": opening_checks, "stage1_from_cache": from_cache,
                        "minutes": minutes_so_far()}, args.stage2_cache)
    polish = curve.restarted()
    if args.polish_steps:
        # seeds of their own (stage 2's + 1 unless --polish-seed): none of stage 2's scenes again; the
        # opening's phase of a stream is the tasks in turn on full scenes, which is what the polish is
        polish_seed = stage_2_seed + 1 if args.polish_seed is None else args.polish_seed
        stream = ShapesStream(0, polish_seed, args.smoke, tasks, **groups,
                              opening_samples=args.polish_steps * args.batch_size, opening_tasks=polish_tasks)
        polish_collator = (ColourWordSwap(collator, args.polish_colour_swap, polish_seed, args.polish_colour_swap_max_shapes)
                           if args.polish_colour_swap else collator)
        train_language_model(model, polish_collator, stream, args, args.polish_steps, args.polish_lr,
                             max(1, args.polish_steps // 10), "cosine", polish)
    minutes = minutes_so_far()
    init_log = None
    if args.init_from and os.path.exists(os.path.join(args.init_from, "training_log.json")):
        with open(os.path.join(args.init_from, "training_log.json")) as handle:
            init_log = json.load(handle)
    # what stage 2 left of stage 1: its heads on the same validation images, scored against the
    # language model's word rows as they are now
    vision_after = (vision_probe(model.model.visual, heads, vision_validation(processor, structured, args.motion_steps > 0))
                    if heads is not None else None)
    print(json.dumps({"vision_after_stage_2": vision_after}), flush=True)

    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(args.out)
    processor.save_pretrained(args.out)
    with open(os.path.join(args.out, "training_log.json"), "w") as handle:
        json.dump({"steps": args.steps, "word_tokenizer": args.word_tokenizer, "vocab_size": len(processor.tokenizer), "batch_size": args.batch_size, "micro_batches": args.micro_batches, "lr": args.lr, "adam_beta2": args.adam_beta2,
                   "warmup": args.warmup, "loss": args.loss, "tasks": args.tasks, "seed": args.seed,
                   "vision_steps": args.vision_steps, "structured_heads": list(structured), "count_heads": args.count_heads, "count_weight": args.count_weight, "motion_steps": args.motion_steps, "vision_lr": args.vision_lr, "vision_batch_size": args.vision_batch_size, "recolour_share": args.recolour_share, "recolour_kinds": args.recolour_kinds,
                   "vision_lr_scale": args.vision_lr_scale, "deepstack_lr_scale": args.deepstack_lr_scale, "frame_difference_lr_scale": args.frame_difference_lr_scale, "text_steps": args.text_steps, "text_every": args.text_every,
                   "existence_group": args.existence_group, "position_group": args.position_group, "centre_group": args.centre_group, "count_group": args.count_group, "followups": args.followups,
                   "centre_steps": args.centre_steps, "centre_first": args.centre_first, "centre_mixed": args.centre_mixed, "centre_mixed_steps": args.centre_mixed_steps, "opening_steps": args.opening_steps, "opening_tasks": args.opening_tasks, "lr_schedule": args.lr_schedule,
                   "opening_bar": args.opening_bar, "opening_tries": args.opening_tries, "opening_checks": opening_checks, "stage_2_seed": stage_2_seed,
                   "polish_steps": args.polish_steps, "polish_lr": args.polish_lr, "polish_tasks": args.polish_tasks, "polish_colour_swap": args.polish_colour_swap,
                   "polish_colour_swap_max_shapes": args.polish_colour_swap_max_shapes, "polish_seed": args.polish_seed,
                   "polish_curve": polish.curve, "polish_evals": polish.evals, "init_from": args.init_from, "init_from_log": init_log,
                   "minutes": round(minutes, 1), "stage1_minutes": round(vision_minutes, 1), "stage1_from_cache": stage_2_cached["stage1_from_cache"] if stage_2_cached else from_cache,
                   "stage2_from_cache": stage_2_cached is not None, "machine": machine(),
                   "vision_curve": vision_curve, "vision_after_stage_2": vision_after, "curve": curve.curve, "evals": curve.evals}, handle, indent=1)
    print(f"trained {args.text_steps} text + {args.centre_steps} centre + {args.opening_steps} opening + {args.steps} "
          f"+ {args.polish_steps} polish steps in {minutes:.1f} min; saved to {args.out}")


if __name__ == "__main__":
    main()

"""vlmkit.data: procedural training and evaluation data.

`shapesworld` generates ShapesWorld, small images of flat shapes (and short clips of one moving) with
short, exactly gradable questions; see its docstring for the tasks and answers.
"""

from . import shapes, shapesworld
from .shapesworld import (
    ANSWER_SETS,
    BACKGROUNDS,
    CAPTION_FIELDS,
    COLOURS,
    CURRICULUM,
    DESCRIBABLE_TASKS,
    HELDOUT_COMBOS,
    KINDS,
    SEEN_COMBOS,
    TASKS,
    as_described_messages,
    as_messages,
    background_questions,
    blank_like,
    box_errors,
    box_to_relative,
    build_dataset,
    caption_field_hits,
    caption_of,
    centre_questions,
    content_hash,
    count_questions,
    existence_questions,
    generate_split,
    grade,
    iou,
    iter_samples,
    kind_questions,
    majority_answers,
    make_sample,
    parse_box,
    parse_caption,
    position_questions,
    relative_box,
    relative_to_box,
    render_scene,
    render_video,
    sample_seed,
    scene_questions,
    size_questions,
)

__all__ = [
    "ANSWER_SETS", "BACKGROUNDS", "CAPTION_FIELDS", "COLOURS", "CURRICULUM", "DESCRIBABLE_TASKS", "HELDOUT_COMBOS", "KINDS", "SEEN_COMBOS", "TASKS",
    "as_described_messages", "as_messages", "background_questions", "blank_like", "box_errors", "box_to_relative", "build_dataset",
    "caption_field_hits", "caption_of", "centre_questions", "content_hash", "count_questions",
    "existence_questions", "generate_split", "grade", "iou", "iter_samples", "kind_questions", "majority_answers", "make_sample", "parse_box", "parse_caption",
    "position_questions",
    "relative_box", "relative_to_box", "render_scene", "render_video", "sample_seed", "scene_questions", "size_questions", "shapes", "shapesworld",
]

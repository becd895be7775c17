"""ShapesWorld generator: determinism, split disjointness, held-out pairs, and answers checked against
the scene by code written independently of the generator's."""

import json
from collections import Counter

import numpy as np
import pytest

from vlmkit.data import shapesworld as sw
from vlmkit.data.shapes import cell_attributes, cell_labels, cell_owners, video_cell_labels

RELATIONS = {"left", "right", "above", "below"}


@pytest.fixture(scope="module")
def dataset():
    return sw.build_dataset(1000, 100, 300, seed=0)


def _pixels(sample):
    frames = sample["video"] if sample["video"] is not None else [sample["image"]]
    return [np.asarray(f.convert("RGB")).tobytes() for f in frames]


def _combos_involved(scene, query):
    combos = {(s["colour"], s["kind"]) for s in scene["shapes"]}
    for q in (query, query.get("a", {}), query.get("b", {})):
        if "colour" in q and "kind" in q:
            combos.add((q["colour"], q["kind"]))
    return combos


def _one(scene, colour, kind):
    found = [s for s in scene["shapes"] if (s["colour"], s["kind"]) == (colour, kind)]
    assert len(found) == 1, (colour, kind, scene["shapes"])
    return found[0]


def _expected_relation(a, b):
    """Independent reference: separated along exactly one axis, overlapping along the other."""
    ax1, ay1, ax2, ay2 = a["box"]
    bx1, by1, bx2, by2 = b["box"]
    overlap_x, overlap_y = ax1 < bx2 and bx1 < ax2, ay1 < by2 and by1 < ay2
    if overlap_y and ax2 < bx1:
        return "left"
    if overlap_y and bx2 < ax1:
        return "right"
    if overlap_x and ay2 < by1:
        return "above"
    if overlap_x and by2 < ay1:
        return "below"
    return None


def test_same_seed_same_sample_different_seed_different():
    for task in sw.TASKS:
        a, b = sw.make_sample(7, task), sw.make_sample(7, task)
        assert _pixels(a) == _pixels(b) and a["hash"] == b["hash"]
        assert (a["question"], a["answer"], a["scene"]) == (b["question"], b["answer"], b["scene"])
        hashes = {sw.make_sample(seed, task)["hash"] for seed in range(20)}
        assert len(hashes) == 20, task
        assert sw.make_sample(7, task, "test")["hash"] != a["hash"]  # splits draw from different streams
    drawn = sw.make_sample(11)  # a drawn task regenerates exactly when named
    assert sw.make_sample(11, drawn["task"])["hash"] == drawn["hash"]


def test_build_dataset_deterministic_and_test_images_not_in_train(dataset):
    again = sw.build_dataset(1000, 100, 300, seed=0)
    for split in ("train", "validation", "test"):
        for column in ("task", "question", "answer", "hash", "heldout", "scene"):
            assert dataset[split][column] == again[split][column], (split, column)
    assert [dataset[s].num_rows for s in ("train", "validation", "test")] == [1000, 100, 300]
    assert sum(dataset["test"]["heldout"]) == 100
    train = set(dataset["train"]["hash"])
    assert len(train) == 1000
    assert not train & set(dataset["test"]["hash"]) and not train & set(dataset["validation"]["hash"])
    # the seed streams are disjoint by themselves, before build_dataset's de-duplication
    raw_test = sw.generate_split("test", 200) + sw.generate_split("test", 100, heldout=True)
    assert not train & {s["hash"] for s in raw_test}
    # stored images decode to the hashed pixels
    for row in dataset["test"].select(range(0, 300, 30)):
        assert sw.content_hash(row["video"] if row["video"] is not None else row["image"]) == row["hash"]


def test_heldout_combos_only_in_heldout_test(dataset):
    assert sw.HELDOUT_COMBOS == (("red", "star"), ("orange", "hexagon"), ("yellow", "circle"),
                                 ("green", "cross"), ("blue", "triangle"), ("purple", "square"))
    assert len(sw.COLOURS) * len(sw.KINDS) == 49 and len(sw.SEEN_COMBOS) == 43
    held = set(sw.HELDOUT_COMBOS)
    for split in ("train", "validation"):
        for row in dataset[split].select_columns(["scene", "query", "question"]):
            assert not _combos_involved(json.loads(row["scene"]), json.loads(row["query"])) & held
            assert not any(f"{c} {k}" in row["question"] for c, k in held)
    test = dataset["test"].select_columns(["scene", "query", "heldout"])
    appeared = set()
    for row in test:
        involved = _combos_involved(json.loads(row["scene"]), json.loads(row["query"])) & held
        assert bool(involved) == row["heldout"]
        appeared |= {(s["colour"], s["kind"]) for s in json.loads(row["scene"])["shapes"]} & held
    assert appeared == held


def _assert_answer_matches_scene(sample):
    """The sample's answer, recomputed from its scene by code independent of the generator's."""
    task, scene, query, answer = sample["task"], sample["scene"], sample["query"], sample["answer"]
    question, shapes = sample["question"], scene["shapes"]
    assert 1 <= len(shapes) <= 5 and sample["image_size"] == (scene["width"], scene["height"])
    if task == "count":
        key = query["variant"]
        expected = len(shapes) if key == "all" else sum(s[key] == query[key] for s in shapes)
        assert answer == str(expected)
        word = {"all": "", "kind": f"{query.get('kind')}s".replace("crosss", "crosses"),
                "colour": query.get("colour")}
        assert word[key] in question
    elif task == "colour":
        (target,) = [s for s in shapes if s["kind"] == query["kind"]]
        assert answer == target["colour"] and query["kind"] in question
    elif task == "existence":
        present = any((s["colour"], s["kind"]) == (query["colour"], query["kind"]) for s in shapes)
        assert answer == ("yes" if present else "no") and f"{query['colour']} {query['kind']}" in question
    elif task == "position":
        a, b = _one(scene, **query["a"]), _one(scene, **query["b"])
        assert answer == _expected_relation(a, b)
        assert f"{a['colour']} {a['kind']}" in question and f"{b['colour']} {b['kind']}" in question
    elif task == "grounding":
        target = _one(scene, query["colour"], query["kind"])
        box = [int(v) for v in answer.strip("[]").split(", ")]
        assert answer == "[{}, {}, {}, {}]".format(*box) and all(0 <= v <= 1000 for v in box)
        w, h = scene["width"], scene["height"]
        assert sw.iou(sw.relative_to_box(box, w, h), target["box"]) > 0.95
        # the box is the drawn extent: pixels of the target's colour near it span exactly the box
        x1, y1, x2, y2 = target["box"]
        pixels = np.asarray(sample["image"])[max(0, y1 - 2):y2 + 2, max(0, x1 - 2):x2 + 2]
        ys, xs = np.nonzero((pixels == sw.COLOURS[target["colour"]]).all(-1))
        left, top = max(0, x1 - 2), max(0, y1 - 2)
        assert [xs.min() + left, ys.min() + top, xs.max() + left + 1, ys.max() + top + 1] == target["box"]
    elif task == "caption":
        ordered = sorted(shapes, key=lambda s: (s["box"][0] + s["box"][2], s["box"][1] + s["box"][3]))
        words = [f"a {s['size']} {s['colour']} {s['kind']}" for s in ordered]
        listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
        assert answer == f"{listed} on a {scene['background']['type']} background."


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_answers_match_scene(split, heldout):
    for seed in range(60):
        for task in ("caption", "count", "colour", "existence", "position", "grounding"):
            _assert_answer_matches_scene(sw.make_sample(seed, task, split, heldout))


def test_existence_balanced_and_answer_sets():
    samples = [sw.make_sample(seed, "existence") for seed in range(400)]
    assert 0.4 <= sum(s["answer"] == "yes" for s in samples) / 400 <= 0.6
    for s in samples:  # a "no" scene shows the asked colour on another kind and the asked kind in another colour
        if s["answer"] == "no" and len(s["scene"]["shapes"]) >= 2:
            q = s["query"]
            assert any(x["colour"] == q["colour"] for x in s["scene"]["shapes"])
            assert any(x["kind"] == q["kind"] for x in s["scene"]["shapes"])
    answers = {task: Counter(sw.make_sample(seed, task)["answer"] for seed in range(100)) for task in sw.TASKS}
    assert set(answers["existence"]) == {"yes", "no"}
    assert set(answers["position"]) == RELATIONS
    assert set(answers["motion"]) == {"left", "right", "up", "down"}
    assert set(answers["colour"]) == set(sw.COLOURS)
    assert set(answers["count"]) == {"0", "1", "2", "3", "4", "5"}
    for task in ("colour", "count", "existence", "position", "motion"):
        assert max(answers[task].values()) / 100 < 0.62, task  # no answer dominates a task
    phrasings = {task: len({sw.make_sample(seed, task)["question"] for seed in range(40)}) for task in ("caption",)}
    templates = {task: len({sw.make_sample(seed, task)["template"] for seed in range(60)}) for task in sw.TASKS}
    assert phrasings["caption"] >= 3 and min(templates.values()) >= 3


def test_video_motion():
    sizes = set()
    for seed in range(50):
        s = sw.make_sample(seed, "motion")
        frames, motion = s["video"], s["scene"]["motion"]
        assert s["image"] is None and s["fps"] == 2.0 and 4 <= len(frames) <= 8 and len(frames) == motion["num_frames"]
        assert {f.size for f in frames} == {s["image_size"]}
        sizes.add(len(frames))
        centres = np.array([[(b[0] + b[2]) / 2, (b[1] + b[3]) / 2] for b in motion["boxes"]])
        axis, sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}[s["answer"]]
        steps = np.diff(centres, axis=0)
        assert (sign * steps[:, axis] > 0).all() and len(set(steps[:, axis])) == 1  # monotonic, constant
        assert (steps[:, 1 - axis] == 0).all()
        target = s["scene"]["shapes"][motion["target"]]
        assert f"{target['colour']} {target['kind']}" in s["question"]
        for frame, (cx, cy) in zip(frames, centres):  # the shape is drawn where the box says
            assert np.asarray(frame)[int(cy), int(cx)].tolist() == list(sw.COLOURS[target["colour"]])
    assert sizes == {4, 5, 6, 7, 8}


def test_image_sizes_shape_counts_and_options():
    samples = [sw.make_sample(seed, task) for seed in range(60) for task in ("caption", "count")]
    sizes = {s["image_size"] for s in samples}
    assert all(96 <= w <= 192 and 96 <= h <= 192 and w % 32 == h % 32 == 0 for w, h in sizes)
    assert all(max(w, h) / min(w, h) <= 2.0 for w, h in sizes)
    assert len(sizes) >= 8 and len({round(w / h, 2) for w, h in sizes}) >= 5 and (192, 96) in sizes
    assert {len(s["scene"]["shapes"]) for s in samples if s["task"] == "caption"} == {1, 2, 3, 4, 5}
    fixed = [sw.make_sample(seed, "grounding", image_size=128, max_shapes=2) for seed in range(20)]
    assert {s["image"].size for s in fixed} == {(128, 128)}
    assert max(len(s["scene"]["shapes"]) for s in fixed) == 2
    easy = [sw.make_sample(seed, difficulty=0) for seed in range(20)]
    assert {s["scene"]["background"]["type"] for s in easy} == {"plain"}
    assert {s["task"] for s in (sw.make_sample(seed, tasks=("count", "colour")) for seed in range(20))} == {
        "count", "colour"}
    assert {sw.make_sample(seed, weights={"motion": 1.0})["task"] for seed in range(5)} == {"motion"}
    with pytest.raises(ValueError):
        sw.make_sample(0, "count", "train", heldout=True)
    with pytest.raises(TypeError):
        sw.make_sample(0, "count", colour_count=3)


def test_messages_blank_and_majority(dataset):
    image_sample, video_sample = sw.make_sample(3, "colour"), sw.make_sample(3, "motion")
    messages = sw.as_messages(image_sample)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"][0] == {"type": "image", "image": image_sample["image"]}
    assert messages[0]["content"][1] == {"type": "text", "text": image_sample["question"]}
    assert messages[1]["content"] == [{"type": "text", "text": image_sample["answer"]}]
    assert sw.as_messages(image_sample, question_first=True)[0]["content"] == messages[0]["content"][::-1]
    video_messages = sw.as_messages(video_sample, include_answer=False)
    assert len(video_messages) == 1 and video_messages[0]["content"][0]["type"] == "video"
    assert len(video_messages[0]["content"][0]["video"]) == len(video_sample["video"])
    row = dataset["train"][0]
    assert sw.as_messages(row)[0]["content"][-1]["text"] == row["question"]

    blank = sw.blank_like(image_sample)
    assert blank["image"].size == image_sample["image"].size and blank["answer"] == image_sample["answer"]
    assert np.unique(np.asarray(blank["image"]).reshape(-1, 3), axis=0).shape[0] == 1
    blank_video = sw.blank_like(video_sample)
    assert len(blank_video["video"]) == len(video_sample["video"]) and blank_video["hash"] != video_sample["hash"]
    assert image_sample["image"] is not blank["image"] and image_sample.get("blank") is None

    rows = [{"task": "count", "answer": "3"}, {"task": "count", "answer": "3"}, {"task": "count", "answer": "1"},
            {"task": "existence", "answer": "yes"}, {"task": "existence", "answer": "no"}]
    assert sw.majority_answers(rows) == {"count": ("3", 2 / 3), "existence": ("no", 0.5)}
    majority = sw.majority_answers(dataset["train"])
    assert set(majority) == set(sw.TASKS)
    assert 0.4 <= majority["existence"][1] <= 0.6 and majority["grounding"][1] < 0.05


def test_box_helpers_and_grading():
    assert sw.box_to_relative([10, 20, 50, 60], 100, 200) == [100, 100, 500, 300]
    assert sw.relative_box([0, 0, 96, 192], 96, 192) == [0, 0, 1000, 1000]
    assert sw.relative_to_box([100, 100, 500, 300], 100, 200) == [10.0, 20.0, 50.0, 60.0]
    assert sw.iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert sw.iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(1 / 3)
    assert sw.iou([0, 0, 10, 10], [10, 10, 20, 20]) == 0.0 and sw.iou(None, [0, 0, 1, 1]) == 0.0
    assert sw.parse_box("It is at [12, 34, 560, 780].") == [12.0, 34.0, 560.0, 780.0]
    assert sw.parse_box("no box") is None
    assert sw.grade("grounding", "[100, 100, 500, 300]", "[110, 100, 500, 300]")
    assert not sw.grade("grounding", "[600, 600, 900, 900]", "[100, 100, 500, 300]")
    assert sw.grade("colour", " Red. ", "red") and not sw.grade("count", "4", "3")
    sample = sw.make_sample(5, "caption")
    assert sw.render_scene(json.loads(json.dumps(sample["scene"]))).tobytes() == sample["image"].tobytes()
    # an "rgb" entry overrides the colour name's fill (stage 1's off-palette shapes), the rest as before
    scene = json.loads(json.dumps(sample["scene"]))
    scene["shapes"][0]["rgb"] = [0, 128, 128]
    x1, y1, x2, y2 = scene["shapes"][0]["box"]
    pixels, before = np.asarray(sw.render_scene(scene)), np.asarray(sample["image"])
    assert pixels[(y1 + y2) // 2, (x1 + x2) // 2].tolist() == [0, 128, 128]
    assert before[(y1 + y2) // 2, (x1 + x2) // 2].tolist() == list(sw.COLOURS[scene["shapes"][0]["colour"]])
    changed = np.argwhere((pixels != before).any(-1))  # (n, 2) rows and columns
    assert len(changed) > 0 and changed[:, 0].min() >= y1 and changed[:, 0].max() < y2
    assert changed[:, 1].min() >= x1 and changed[:, 1].max() < x2


def test_cell_labels_follow_the_largest_overlap():
    scene = {"width": 96, "height": 64, "shapes": [
        # inside cell (row 0, col 0)
        {"kind": "star", "colour": "blue", "box": [4, 4, 20, 20]},
        # 40 x 40 across cols 1-2 of row 1 (and 8 px into row 0): x 40-64 in col 1 (24 px), 64-80 in col 2
        {"kind": "circle", "colour": "red", "box": [40, 24, 80, 64]},
    ]}
    labels = cell_labels(scene, cell=32)
    bg_kind, bg_colour = len(sw.KINDS), len(sw.COLOURS)
    star, circle = sw.KINDS.index("star"), sw.KINDS.index("circle")
    blue, red = list(sw.COLOURS).index("blue"), list(sw.COLOURS).index("red")
    # circle overlaps: (row 0, col 1) 24 x 8 = 192 px, under 25% of the cell (256): background;
    # (row 0, col 2) 16 x 8; (row 1, col 1) 24 x 32 = 768; (row 1, col 2) 16 x 32 = 512
    assert labels["kind"].tolist() == [[star, bg_kind, bg_kind], [bg_kind, circle, circle]]
    assert labels["colour"].tolist() == [[blue, bg_colour, bg_colour], [bg_colour, red, red]]
    assert labels["centre"].tolist() == [[1, 0, 0], [0, 1, 0]]  # centres (12, 12) and (60, 44)
    with pytest.raises(ValueError, match="100x64 is not a multiple of the 32 px cell"):
        cell_labels({**scene, "width": 100}, cell=32)


def test_cell_attributes_give_each_cell_what_its_shape_and_scene_answer():
    # three shapes on a 96 x 64 image (2 rows x 3 cols of 32 px cells): two blue, two stars
    scene = {"width": 96, "height": 64, "background": {"type": "checkered"}, "shapes": [
        {"kind": "star", "colour": "blue", "size": "small", "box": [68, 4, 92, 28], "centre": [80, 16]},
        {"kind": "circle", "colour": "blue", "size": "large", "box": [40, 24, 80, 64], "centre": [60, 44]},
        {"kind": "star", "colour": "red", "size": "small", "box": [4, 36, 28, 60], "centre": [16, 48]},
    ]}
    # the circle wins (1, 1) and (1, 2); its 16 x 8 corner of (0, 2) loses to the star's 24 x 24
    assert cell_owners(scene).tolist() == [[-1, -1, 0], [2, 1, 1]]
    cells = cell_attributes(scene)
    assert cells["total"].tolist() == [[3, 3, 3], [3, 3, 3]]
    assert cells["colour_count"].tolist() == [[0, 0, 2], [1, 2, 2]]
    assert cells["kind_count"].tolist() == [[0, 0, 2], [2, 1, 1]]
    assert cells["size"].tolist() == [[2, 2, 0], [0, 1, 1]]
    # left to right by centre x: red star (16), blue circle (60), blue star (80); background 3
    assert cells["rank"].tolist() == [[3, 3, 2], [0, 1, 1]]
    assert cells["background_type"].tolist() == [[sw.BACKGROUNDS.index("checkered")] * 3] * 2
    assert cells["where"].tolist() == [[[1 / 6, 0.25], [0.5, 0.25], [5 / 6, 0.25]],
                                       [[1 / 6, 0.75], [0.5, 0.75], [5 / 6, 0.75]]]
    # place: where - 0.5 on the shapes' cells, 0 on background
    assert np.allclose(cells["place"], [[[0, 0], [0, 0], [1 / 3, -0.25]], [[-1 / 3, 0.25], [0, 0.25], [1 / 3, 0.25]]])
    # relative boxes: the star [708, 62, 958, 438], the circle [417, 375, 833, 1000] on both its cells
    assert cells["box_digits"][0, 2].tolist() == [7, 0, 8, 0, 6, 2, 9, 5, 8, 4, 3, 8]
    assert cells["box_digits"][1, 1].tolist() == cells["box_digits"][1, 2].tolist() == [4, 1, 7, 3, 7, 5, 8, 3, 3, 10, 0, 0]
    assert cells["box_digits"][0, 0].tolist() == [11] * 12
    # the owners are cell_labels' too
    labels = cell_labels(scene)
    assert labels["kind"].tolist() == [[len(sw.KINDS)] * 2 + [sw.KINDS.index("star")],
                                       [sw.KINDS.index("star"), sw.KINDS.index("circle"), sw.KINDS.index("circle")]]


def test_video_cell_labels_mark_the_moving_shape_on_both_frames_of_a_slice():
    # 96 x 64 (2 x 3 cells); a red circle moves right 32 px a frame along row 0 over 3 frames (padded
    # to 4: slices (0, 1) and (2, 2)); a blue star stands still in cell (1, 0)
    boxes = [[4, 4, 28, 28], [36, 4, 60, 28], [68, 4, 92, 28]]
    scene = {"width": 96, "height": 64, "shapes": [
        {"kind": "star", "colour": "blue", "box": [4, 36, 28, 60]},
        {"kind": "circle", "colour": "red", "box": boxes[0]},
    ], "motion": {"target": 1, "direction": "right", "num_frames": 3, "boxes": boxes, "step": 32}}
    labels = video_cell_labels(scene, cell=32, temporal_patch_size=2)
    assert {name: a.shape for name, a in labels.items()} == {name: (2, 2, 3) for name in ("kind", "colour", "centre", "motion")}
    bg, star, circle = len(sw.KINDS), sw.KINDS.index("star"), sw.KINDS.index("circle")
    right, still = sw.DIRECTIONS.index("right"), len(sw.DIRECTIONS)
    assert labels["kind"].tolist() == [[[circle, circle, bg], [star, bg, bg]], [[bg, bg, circle], [star, bg, bg]]]
    assert labels["motion"].tolist() == [[[right, right, still], [still] * 3], [[still, still, right], [still] * 3]]
    red, blue, bg_colour = list(sw.COLOURS).index("red"), list(sw.COLOURS).index("blue"), len(sw.COLOURS)
    assert labels["colour"][0].tolist() == [[red, red, bg_colour], [blue, bg_colour, bg_colour]]
    # centres where the shapes are in each slice's first frame (the circle's at frames 0 and 2)
    assert labels["centre"].tolist() == [[[1, 0, 0], [1, 0, 0]], [[0, 0, 1], [1, 0, 0]]]
    # the scene itself is left as it was
    assert scene["shapes"][1]["box"] == boxes[0]


def test_described_messages_put_the_caption_in_place_of_the_image():
    scene = {"background": {"type": "striped"},
             "shapes": [{"kind": "star", "colour": "red", "size": "small", "centre": [90, 40]},
                        {"kind": "circle", "colour": "blue", "size": "large", "centre": [20, 60]}]}
    sample = {"task": "existence", "scene": scene, "question": "Is there a red star?", "answer": "yes"}
    assert sw.as_described_messages(sample) == [
        {"role": "user", "content": [{"type": "text", "text":
            "A large blue circle and a small red star on a striped background. Is there a red star?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}]
    assert len(sw.as_described_messages(sample, include_answer=False)) == 1
    # on generated samples the caption names the shapes the answer is about
    real = sw.make_sample(5, "colour")
    text = sw.as_described_messages(real)[0]["content"][0]["text"]
    assert f"{real['answer']} {real['query']['kind']}" in text and text.endswith(real["question"])
    with pytest.raises(ValueError, match="'grounding' sample cannot be answered from its caption"):
        sw.as_described_messages(sw.make_sample(5, "grounding"))


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_existence_questions_are_minimal_pairs_answered_by_the_scene(split, heldout):
    kind_changes = colour_changes = 0
    for seed in range(60):
        sample = sw.make_sample(seed, "count", split=split, heldout=heldout)
        questions = sw.existence_questions(sample, seed)
        assert [q["question"] for q in questions] == [q["question"] for q in sw.existence_questions(sample, seed)]
        present = {(s["colour"], s["kind"]) for s in sample["scene"]["shapes"]}
        asked = [(q["query"]["colour"], q["query"]["kind"]) for q in questions]
        for question, combo in zip(questions, asked):
            # the answer, recomputed from the scene; the question names exactly that colour and kind
            assert question["answer"] == ("yes" if combo in present else "no")
            assert f"{combo[0]} {combo[1]}" in question["question"] and question["task"] == "existence"
            assert question["scene"] == sample["scene"] and question["image"] is sample["image"]
            assert heldout or combo not in sw.HELDOUT_COMBOS
        no = [c for c in asked if c not in present]
        assert len(no) == 2  # half "yes", half "no"
        # a "no" keeps one word of a shape in the scene and changes the other
        for colour, kind in no:
            assert any((colour == c) != (kind == k) for c, k in present)
        kind_changes += sum(any(colour == c for c, _ in present) for colour, _ in no)
        colour_changes += sum(any(kind == k for _, k in present) for _, kind in no)
    assert kind_changes >= 50 and colour_changes >= 50  # both kinds of "no", about one each per scene
    # shuffled: the first question is not always a "yes"
    first = Counter(sw.existence_questions(sw.make_sample(s, "count"), s)[0]["answer"] for s in range(200))
    assert 70 <= first["yes"] <= 130
    with pytest.raises(ValueError, match="count must be even"):
        sw.existence_questions(sw.make_sample(0, "count"), 0, count=3)


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_count_questions_ask_each_variant_in_turn_answered_by_the_scene(split, heldout):
    variants, zeros, distinct = Counter(), 0, 0
    for seed in range(60):
        sample = sw.make_sample(seed, "count", split=split, heldout=heldout)
        questions = sw.count_questions(sample, seed, 8)
        assert [q["question"] for q in questions] == [q["question"] for q in sw.count_questions(sample, seed, 8)]
        shapes = sample["scene"]["shapes"]
        per_scene = Counter(q["query"]["variant"] for q in questions)
        assert len(questions) == 8 and sorted(per_scene.values()) == [2, 3, 3]  # the three variants in turn
        for q in questions:
            variant = q["query"]["variant"]
            assert q["task"] == "count" and q["scene"] == sample["scene"] and q["image"] is sample["image"]
            # the answer, recounted from the scene; the question names the colour or kind counted
            expected = len(shapes) if variant == "all" else sum(s[variant] == q["query"][variant] for s in shapes)
            assert q["answer"] == str(expected)
            if variant == "colour":
                assert q["query"]["colour"] in q["question"]
            elif variant == "kind":
                assert sw.PLURALS[q["query"]["kind"]] in q["question"]
            variants[variant] += 1
            zeros += q["answer"] == "0"
        distinct += len({q["answer"] for q in questions}) >= 2
    assert min(variants.values()) >= 150  # 480 questions, each variant about a third
    # the colour and kind questions take turns between a value the scene shows and one it lacks ("0"),
    # so every scene's questions have different answers and no one answer fits them all
    assert 120 <= zeros <= 180  # about half of the 5-6 colour and kind questions of 8
    assert distinct == 60
    with pytest.raises(ValueError, match="count must be at least 1"):
        sw.count_questions(sw.make_sample(0, "count"), 0, count=0)


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_position_questions_ask_each_pair_both_ways(split, heldout):
    from vlmkit.data.shapes import centre

    opposite = {"left": "right", "right": "left", "above": "below", "below": "above"}
    answers = Counter()
    for seed in range(60):
        sample = sw.make_sample(seed, "position", split=split, heldout=heldout)
        questions = sw.position_questions(sample, seed, 8)
        assert [q["question"] for q in questions] == [q["question"] for q in sw.position_questions(sample, seed, 8)]
        assert len(questions) == 8 and all(q["task"] == "position" and q["scene"] == sample["scene"] for q in questions)
        shapes = {(s["colour"], s["kind"]): s for s in sample["scene"]["shapes"]}
        asked = Counter()
        for q in questions:
            a, b = ((q["query"][k]["colour"], q["query"][k]["kind"]) for k in ("a", "b"))
            assert f"{a[0]} {a[1]}" in q["question"] and f"{b[0]} {b[1]}" in q["question"]
            assert heldout or (a not in sw.HELDOUT_COMBOS and b not in sw.HELDOUT_COMBOS)
            # the answer, from the two shapes' centres: the larger offset's axis and sign
            (ax, ay), (bx, by) = centre(shapes[a]["box"]), centre(shapes[b]["box"])
            dx, dy = ax - bx, ay - by
            expected = ("left" if dx < 0 else "right") if abs(dx) > abs(dy) else ("above" if dy < 0 else "below")
            assert q["answer"] == expected
            asked[(a, b, q["answer"])] += 1
            answers[q["answer"]] += 1
        # every pair as often one way as the other, with the opposite answer
        assert all(asked[(b, a, opposite[where])] == n for (a, b, where), n in asked.items())
    assert min(answers.values()) >= 60  # 480 answers, each relation at least an eighth of them
    with pytest.raises(ValueError, match="count must be even"):
        sw.position_questions(sw.make_sample(0, "position"), 0, count=3)
    lone = sw.make_sample(0, "colour", min_shapes=1, max_shapes=1)
    with pytest.raises(ValueError, match=r"no two shapes .* \(1 shapes, 1 unique\)"):
        sw.position_questions(lone, 0)


def test_centre_relation_takes_the_clear_axis_of_the_offset_from_the_image_centre():
    # a 200 x 100 image: offsets as fractions of the width and of the height
    assert sw.centre_relation((10, 40, 30, 60), 200, 100) == "left"  # dx -0.4, dy 0
    assert sw.centre_relation((170, 45, 190, 55), 200, 100) == "right"
    assert sw.centre_relation((90, 0, 110, 20), 200, 100) == "above"  # dy -0.4
    assert sw.centre_relation((90, 80, 110, 100), 200, 100) == "below"
    assert sw.centre_relation((95, 45, 105, 55), 200, 100) is None  # on the centre
    assert sw.centre_relation((100, 45, 120, 55), 200, 100) is None  # dx 0.05, under the 0.1 margin
    assert sw.centre_relation((140, 70, 160, 90), 200, 100) is None  # dx 0.25, dy 0.3: no axis 1.5 times the other
    assert sw.centre_relation((140, 70, 160, 90), 200, 100, margin=0.0) is None
    assert sw.centre_relation((160, 60, 180, 80), 200, 100) == "right"  # dx 0.35 >= 1.5 * dy 0.2


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_centre_questions_ask_each_clear_shape_once(split, heldout):
    answers, empty = Counter(), 0
    for seed in range(60):
        sample = sw.make_sample(seed, "count", split=split, heldout=heldout)
        questions = sw.centre_questions(sample, seed, 3)
        assert questions == sw.centre_questions(sample, seed, 3)
        scene = sample["scene"]
        shapes = {(s["colour"], s["kind"]): s for s in scene["shapes"]}
        named = Counter((s["colour"], s["kind"]) for s in scene["shapes"])
        clear = [c for c, s in shapes.items() if named[c] == 1 and sw.centre_relation(s["box"], scene["width"], scene["height"])
                 and (heldout or c not in sw.HELDOUT_COMBOS)]
        assert len(questions) == min(3, len(clear))
        empty += not questions
        asked = [(q["query"]["a"]["colour"], q["query"]["a"]["kind"]) for q in questions]
        assert len(set(asked)) == len(asked) and set(asked) <= set(clear)
        for q, combo in zip(questions, asked):
            assert q["task"] == "position" and q["query"]["b"] == sw.CENTRE and q["scene"] == scene
            assert q["question"] == sw.TEMPLATES["position"][q["template"]].format(a=f"{combo[0]} {combo[1]}",
                                                                                   b="centre of the image")
            assert q["answer"] == sw.centre_relation(shapes[combo]["box"], scene["width"], scene["height"])
            answers[q["answer"]] += 1
    assert sum(answers.values()) >= 90 and min(answers.values()) >= sum(answers.values()) // 8
    assert empty < 20


@pytest.mark.parametrize("split,heldout", [("train", False), ("test", True)])
def test_scene_questions_are_answered_by_the_scene(split, heldout):
    asked = Counter()
    for seed in range(40):
        for task in ("caption", "count", "colour", "existence", "position", "grounding"):
            sample = sw.make_sample(seed, task, split, heldout)
            questions = sw.scene_questions(sample, seed, 6)
            assert [(q["question"], q["answer"]) for q in questions] == [
                (q["question"], q["answer"]) for q in sw.scene_questions(sample, seed, 6)]
            assert 1 <= len(questions) <= 6
            for question in questions:
                _assert_answer_matches_scene(question)
                assert question["scene"] == sample["scene"] and question["image"] is sample["image"]
                assert heldout or not _combos_involved(question["scene"], question["query"]) & set(sw.HELDOUT_COMBOS)
                asked[question["task"]] += 1
            # no question asked twice, in any phrasing, the sample's own included
            queries = [json.dumps([q["task"], {k: v for k, v in q["query"].items() if k != "present"}], sort_keys=True)
                       for q in [sample, *questions]]
            assert len(set(queries)) == len(queries)
            assert sum(q["task"] == "caption" for q in [sample, *questions]) <= 1
    assert set(asked) == {"caption", "count", "colour", "existence", "position", "grounding"}
    assert min(asked.values()) >= 60  # every task asked often
    # only what the tasks allow; videos and count 0 get none
    only = sw.scene_questions(sw.make_sample(3, "caption"), 3, 5, tasks=("colour", "count"))
    assert {q["task"] for q in only} <= {"colour", "count"} and only
    assert sw.scene_questions(sw.make_sample(3, "motion"), 3, 5) == []
    assert sw.scene_questions(sw.make_sample(3, "count"), 3, 0) == []
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['size'\]"):
        sw.scene_questions(sw.make_sample(3, "count"), 3, 2, tasks=("size",))


def test_messages_with_followups_are_one_conversation():
    sample = sw.make_sample(7, "colour")
    followups = sw.scene_questions(sample, 7, 2, tasks=("count", "existence"))
    messages = sw.as_messages(sample, followups=followups)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert messages[0]["content"][0] == {"type": "image", "image": sample["image"]}
    assert messages[:2] == sw.as_messages(sample)  # the first turn is the sample as evaluated
    for followup, (user, assistant) in zip(followups, zip(messages[2::2], messages[3::2])):
        assert user["content"] == [{"type": "text", "text": followup["question"]}]
        assert assistant["content"] == [{"type": "text", "text": followup["answer"]}]
    described = sw.as_described_messages(sample, followups=followups)
    assert described[:2] == sw.as_described_messages(sample) and described[2:] == messages[2:]
    with pytest.raises(ValueError, match="'grounding' sample cannot be answered from its caption"):
        sw.as_described_messages(sample, followups=sw.scene_questions(sample, 7, 1, tasks=("grounding",)))
    with pytest.raises(ValueError, match="follow-up questions need the first answer"):
        sw.as_messages(sample, include_answer=False, followups=followups)


def test_captions_and_boxes_read_back_field_by_field():
    truth = "a small red circle, a large blue star and a small green square on a striped background."
    assert sw.parse_caption(truth) == ([("small", "red", "circle"), ("large", "blue", "star"),
                                        ("small", "green", "square")], "striped")
    assert sw.parse_caption(" A large orange hexagon on an Plain background ") == ([("large", "orange", "hexagon")], "plain")
    assert sw.parse_caption("above") is None
    assert sw.parse_caption("a red circle and a large blue star on a plain background.")[0] == [None, ("large", "blue", "star")]
    # two shapes of three said, the second in the wrong colour, the background wrong
    hits = sw.caption_field_hits("a small red circle and a large red star on a plain background.", truth)
    assert hits == {"background": [False], "shape_count": [False], "size": [True, True, False],
                    "colour": [True, False, False], "kind": [True, True, False]}
    assert all(not any(h) for h in sw.caption_field_hits("left", truth).values())
    # every caption the generator writes reads back as its scene, left to right
    for seed in range(40):
        sample = sw.make_sample(seed, "caption")
        shapes = sorted(sample["scene"]["shapes"], key=lambda s: (s["centre"][0], s["centre"][1]))
        assert sw.parse_caption(sample["answer"]) == ([(s["size"], s["colour"], s["kind"]) for s in shapes],
                                                      sample["scene"]["background"]["type"])
        assert all(all(h) for h in sw.caption_field_hits(sample["answer"], sample["answer"]).values())
    assert sw.box_errors("[100, 100, 300, 300]", "[130, 140, 330, 340]") == (50.0, 1.0)
    assert sw.box_errors("[0, 0, 400, 100]", "[0, 0, 100, 100]") == (150.0, 2.0)
    assert sw.box_errors("no box", "[0, 0, 1, 1]") is None and sw.box_errors("[5, 5, 5, 9]", "[0, 0, 1, 1]") is None


def test_background_and_size_questions_read_what_the_caption_says():
    sample = sw.make_sample(3, task="colour")
    (background,) = sw.background_questions(sample, seed=1)
    assert background["answer"] == sample["scene"]["background"]["type"] and background["task"] == "background"
    assert background["question"] in sw.ATTRIBUTE_TEMPLATES["background"] and sw.background_questions(sample, 1, 0) == []
    sizes = sw.size_questions(sample, seed=2, count=9)
    shapes = {(s["colour"], s["kind"]): s["size"] for s in sample["scene"]["shapes"]}
    assert len(sizes) == len(shapes) == 4  # each shape once, as many as the scene has
    for q in sizes:
        combo = (q["query"]["colour"], q["query"]["kind"])
        assert q["answer"] == shapes[combo] and f"{combo[0]} {combo[1]}" in q["question"]
    caption = sw.parse_caption(sw.caption_of(sample["scene"]))
    assert caption[1] == background["answer"] and sorted(s for s, _, _ in caption[0]) == sorted(q["answer"] for q in sizes)
    assert sw.size_questions(sample, seed=2, count=2) == sw.size_questions(sample, seed=2, count=2)


def test_kind_questions_name_a_shape_by_its_unique_colour_and_ask_its_kind():
    sample = sw.make_sample(3, task="colour")
    colours = Counter(s["colour"] for s in sample["scene"]["shapes"])
    named = {s["colour"]: s["kind"] for s in sample["scene"]["shapes"] if colours[s["colour"]] == 1}
    kinds = sw.kind_questions(sample, seed=2, count=9)
    assert sorted(q["query"]["colour"] for q in kinds) == sorted(named) and len(kinds) == 2  # 4 shapes, 2 colours unique
    for q in kinds:
        assert q["task"] == "kind" and q["answer"] == named[q["query"]["colour"]]
        assert q["question"] == sw.ATTRIBUTE_TEMPLATES["kind"][q["template"]].format(colour=q["query"]["colour"])
    assert len(sw.kind_questions(sample, seed=2, count=1)) == 1
    assert sw.kind_questions(sample, seed=2, count=2) == sw.kind_questions(sample, seed=2, count=2)
    # a train scene never asks a held-out pair's kind, even when its colour is unique
    heldout = sw.make_sample(5, task="caption", split="test", heldout=True)
    as_train = dict(heldout, split="train", heldout=False)
    pairs = {(q["query"]["colour"], q["answer"]) for i in range(20) for q in sw.kind_questions(as_train, i)}
    assert pairs and not pairs & set(sw.HELDOUT_COMBOS)
    assert {(q["query"]["colour"], q["answer"]) for q in sw.kind_questions(heldout, 0)} & set(sw.HELDOUT_COMBOS) == {
        ("yellow", "circle")}  # asked in the held-out sample itself

import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import OFFLINE_ENV, load_script, run_train_shapes
from PIL import Image
from transformers import TrainerCallback

from vlmkit import VLMKitProcessor, default_model_path
from vlmkit.cli import COUNT_VARIANTS, load
from vlmkit.data import COLOURS, HELDOUT_COMBOS, KINDS, SEEN_COMBOS, as_messages, make_sample
from vlmkit.training import VLMKitDataCollator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_load_qwen3vl_checkpoint_example_reports_parity():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "load_qwen3vl_checkpoint.py")],
        capture_output=True, text=True, timeout=300, env=OFFLINE_ENV,
    )
    assert result.returncode == 0, result.stderr
    assert "missing=[] unexpected=[]" in result.stdout
    line = next(text for text in result.stdout.splitlines() if text.startswith("max |logit difference|"))
    assert float(line.rsplit(":", 1)[1]) <= 1e-5
    assert "greedy generation of 12 tokens identical: True" in result.stdout


@pytest.mark.slow
def test_compare_connectors_writes_table_plot_and_json(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "compare_connectors.py"), "--steps", "2", "--batch-size", "2",
         "--eval", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=OFFLINE_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "compare_connectors.json").read_text())["rows"]
    assert [r["connector"] for r in rows] == ["merger", "mlp", "qformer", "resampler"]
    # 128x128 px = 8x8 patches: the merger and mlp keep the grid (2x2 merged / every patch), the
    # query connectors emit their 16 queries
    assert [r["visual_tokens"] for r in rows] == [16, 64, 16, 16]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["step_seconds"] > 0 and r["parameters_m"] > 0 for r in rows)
    table = (tmp_path / "compare_connectors.md").read_text()
    assert all(f"| {r['connector']} |" in table for r in rows)
    with Image.open(tmp_path / "compare_connectors.png") as plot:
        assert plot.size == (5 * 260, 220 + 2 * 30)


def load_example(name: str):
    return load_script("examples", name)


def test_probe_question_use_asks_about_each_shape_and_counterfactuals():
    probe = load_example("probe_question_use")
    colour = probe.two_shape_colour_questions(5)
    assert len(colour) == 10
    for first, second in zip(colour[0::2], colour[1::2]):
        shapes = first["scene"]["shapes"]
        assert second["scene"] == first["scene"] and len(shapes) == 2 and shapes[0]["kind"] != shapes[1]["kind"]
        assert [first["question"], second["question"]] == [f"What colour is the {s['kind']}?" for s in shapes]
        assert [first["answer"], second["answer"]] == [s["colour"] for s in shapes]
    existence = probe.one_shape_existence_questions(5)
    assert len(existence) == 15
    for i in range(5):
        same, other_colour, other_kind = existence[3 * i:3 * i + 3]
        (shape,) = same["scene"]["shapes"]
        assert same["question"] == f"Is there a {shape['colour']} {shape['kind']}?"
        assert other_colour["question"].endswith(f" {shape['kind']}?") and f" {shape['colour']} " not in other_colour["question"]
        assert other_kind["question"].startswith(f"Is there a {shape['colour']} ") and not other_kind["question"].endswith(f" {shape['kind']}?")
        assert [same["answer"], other_colour["answer"], other_kind["answer"]] == ["yes", "no", "no"]
    for heldout, pairs in ((True, HELDOUT_COMBOS), (False, SEEN_COMBOS)):
        lone = probe.one_shape_colour_questions(6, heldout=heldout)
        shapes = [s["scene"]["shapes"] for s in lone]
        assert len(lone) == 6 and all(len(group) == 1 for group in shapes)
        assert all((g[0]["colour"], g[0]["kind"]) in pairs for g in shapes) and {s["split"] for s in lone} == {"test"}
        assert [(s["question"], s["answer"]) for s in lone] == [(f"What colour is the {g[0]['kind']}?", g[0]["colour"]) for g in shapes]
    for colour in COLOURS:
        for kind in KINDS:
            other = probe.seen_pair_colour({"colour": colour, "kind": kind})
            assert other != colour and (other, kind) in SEEN_COMBOS
    model, processor = load(None)
    report = probe.probe(model, processor, num_scenes=4)
    assert set(report["one_shape_colour"]) == set(report["caption_kind_after_colour"]) == {"seen", "held_out"}
    for entry in report["caption_kind_after_colour"].values():
        assert entry["scenes"] == 4 and {4 * entry["own_colour"], 4 * entry["seen_pair_colour"]} <= {0, 1, 2, 3, 4}
    for entry in report["one_shape_colour"].values():
        assert entry["scenes"] == 4 and 0.0 <= entry["accuracy"] <= 1.0
        # one shape a scene, 32 px tokens: a few tokens each, the shipped tower's colour still its own word's
        assert 4 <= entry["tokens_nearest_name"]["shape_tokens"] <= 100 and entry["tokens_nearest_name"]["colour"] >= 0.9
    assert report["two_shape_colour"]["scenes"] == report["one_shape_existence_yes_rate"]["scenes"] == 4
    rates = [*report["two_shape_colour"].values(), *report["one_shape_existence_yes_rate"].values()]
    assert all(0.0 <= r <= 1.0 for r in rates if isinstance(r, float))
    # the shipped tower's shape tokens lie nearest their own colour's word (stage 1's alignment) ...
    aligned = report["visual_tokens_nearest_name"]
    assert aligned["shape_tokens"] > 300 and aligned["colour"] >= 0.9 and 0.0 <= aligned["kind"] <= 1.0
    # ... and rotating the colour words' embedding rows sends them to the wrong names
    ids = [i[0] for i in probe.name_token_ids(processor.tokenizer, COLOURS)]
    weight = model.get_input_embeddings().weight
    original = weight.data.clone()
    try:
        weight.data[ids] = original[ids[1:] + ids[:1]]
        assert probe.visual_word_alignment(model, processor)["colour"] <= 0.3
    finally:
        weight.data.copy_(original)


def _stream_rows(stream, n):
    rows = []
    for row in itertools.islice(iter(stream), n):
        content = row["messages"][0]["content"]
        rows.append({"text": content[-1]["text"], "answer": row["messages"][1]["content"][0]["text"],
                     "as_text": content[0]["type"] == "text"})
    return rows


def test_train_shapes_stream_groups_existence_as_minimal_pairs_and_keeps_the_task_mix():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=20_000, seed=0, smoke=False, text_samples=320, text_every=4)
    grouped = _stream_rows(train_shapes.ShapesStream(**kwargs, existence_group=4), 2000)
    single = _stream_rows(train_shapes.ShapesStream(**kwargs, existence_group=1), 2000)
    existence = [i for i, r in enumerate(grouped) if r["answer"] in ("yes", "no")]
    # the same share of existence samples either way (up to the group cut at the end), but in runs
    # of 4 about one scene, half "yes"
    assert abs(len(existence) - sum(r["answer"] in ("yes", "no") for r in single)) < 4
    existence = existence[:len(existence) // 4 * 4]
    assert existence[::4] == [i - 3 for i in existence[3::4]]
    for start in existence[::4]:
        group = grouped[start:start + 4]
        assert sorted(r["answer"] for r in group) == ["no", "no", "yes", "yes"]
        assert len({r["as_text"] for r in group}) == 1
        if group[0]["as_text"]:  # described scenes: one caption, four questions
            assert len({r["text"].split(". ")[0] for r in group}) == 1
    # the text warm-up (320 samples), then one in four of each describable task as text
    assert all(r["as_text"] for r in grouped[:320])
    later = grouped[320:]
    assert 0.15 <= sum(r["as_text"] for r in later) / len(later) <= 0.25
    assert abs(sum(r["as_text"] for r in single[320:]) - sum(r["as_text"] for r in later)) <= 8


def test_train_shapes_stream_groups_position_both_ways_and_keeps_the_task_mix():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=3000, seed=0, smoke=False, text_samples=0, existence_group=8)
    grouped = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs, position_group=4)), 3000))
    single = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs)), 3000))

    def position(rows):  # (index, question, answer) of each position question
        found = []
        for i, row in enumerate(rows):
            text = row["messages"][0]["content"][-1]["text"]
            answer = row["messages"][1]["content"][0]["text"]
            if answer in ("left", "right", "above", "below") and row["messages"][0]["content"][0]["type"] == "image":
                found.append((i, text, answer))  # (motion's clips answer "left" and "right" too)
        return found

    asked, plain = position(grouped), position(single)
    assert len(plain) > 100 and abs(len(asked) - len(plain)) < 4  # the same share of position samples
    # in runs of four about one scene: two pairs, each asked both ways with opposite answers
    opposite = {"left": "right", "right": "left", "above": "below", "below": "above"}
    runs = [asked[i:i + 4] for i in range(0, len(asked) // 4 * 4, 4)]
    assert all(run[-1][0] - run[0][0] == 3 for run in runs)
    for run in runs:
        assert sorted(a for _, _, a in run) == sorted(opposite[a] for _, _, a in run)
    # the other tasks' samples are those of the ungrouped stream
    asked_at, plain_at = {i for i, _, _ in asked}, {i for i, _, _ in plain}
    others = [r for i, r in enumerate(grouped) if i not in asked_at]

    def text(row):
        return row["messages"][0]["content"][-1]["text"], row["messages"][1]["content"][0]["text"]

    assert [text(r) for r in others[:300]] == [text(r) for i, r in enumerate(single) if i not in plain_at][:300]


def test_train_shapes_stream_asks_count_questions_in_groups_about_one_scene():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=100_000, seed=0, smoke=False, tasks=("colour", "count"), existence_group=1)
    rows = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs, count_group=4)), 400))
    single = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs)), 400))

    def counts(stream_rows):  # (index, image bytes, answer) of each count question
        return [(i, r["messages"][0]["content"][0]["image"].tobytes(), r["messages"][1]["content"][0]["text"])
                for i, r in enumerate(stream_rows) if r["messages"][1]["content"][0]["text"].isdigit()]

    asked = counts(rows)
    assert len(asked) == 200 and len(counts(single)) == 200  # every other slot either way
    groups = [asked[i:i + 4] for i in range(0, 200, 4)]
    assert all(group[-1][0] - group[0][0] == 3 for group in groups)  # side by side
    assert all(len({image for _, image, _ in group}) == 1 for group in groups)  # about one scene
    assert len({group[0][1] for group in groups}) == 50  # and a new scene for each group
    # the answer prior cannot fit a whole group: each asks a colour or kind the scene shows and one it lacks
    assert all(len({answer for _, _, answer in group}) > 1 for group in groups)
    assert all("0" in {answer for _, _, answer in group} for group in groups)
    # the colour samples are those of the ungrouped stream
    colour = [r for r in rows if not r["messages"][1]["content"][0]["text"].isdigit()]
    assert colour == [r for r in single if not r["messages"][1]["content"][0]["text"].isdigit()]


def test_train_shapes_stream_opens_with_the_probes_tasks_on_full_scenes():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=2400, seed=0, smoke=False, text_samples=32, text_every=4)
    plain = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs)), 400))
    opened = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs, opening_samples=96)), 496))
    assert opened[:32] == plain[:32] and opened[128:] == plain[32:]  # text warm-up and curriculum unchanged
    answers = [row["messages"][1]["content"][0]["text"] for row in opened[32:128]]
    for i, (row, answer) in enumerate(zip(opened[32:128], answers)):
        assert row["messages"][0]["content"][0]["type"] == "image"  # shown, never described
        expected = (COLOURS, ("yes", "no"), tuple(map(str, range(9))))[i % 3]
        assert answer in expected, (i, answer)
    # full scenes: counts of three and more, where the curriculum's first level has at most two shapes
    assert max(map(int, answers[2::3])) >= 3
    with pytest.raises(ValueError, match="opening tasks spelling are neither ShapesWorld tasks .* nor precursors \(centre, background, size, kind\)"):
        train_shapes.ShapesStream(**kwargs, opening_samples=8, opening_tasks=("colour", "spelling"))


def test_train_shapes_stream_asks_centre_questions_in_groups_about_one_scene():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=100_000, seed=0, smoke=False, tasks=("colour", "centre"), existence_group=1)
    rows = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs, centre_group=4)), 400))
    centre = [(i, r) for i, r in enumerate(rows) if "centre of the image" in r["messages"][0]["content"][-1]["text"]]
    assert len(centre) == 200  # every other slot, in groups of four side by side
    assert {r["messages"][1]["content"][0]["text"] for _, r in centre} == {"left", "right", "above", "below"}
    assert all(r["messages"][0]["content"][0]["type"] == "image" for _, r in centre)
    assert [i for i, _ in centre[::4]] == [i - 3 for i, _ in centre[3::4]]
    images = Counter()
    for start in range(0, len(centre), 4):  # never one shape twice in a group
        group = [(row["messages"][0]["content"][0]["image"].tobytes(), row["messages"][0]["content"][-1]["text"])
                 for _, row in centre[start:start + 4]]
        assert len(set(group)) == 4
        images.update(Counter(image for image, _ in group).values())
    assert images[1] and images[2] and images[3] + images[4] == 0  # level 0: scenes of one or two shapes
    # --centre-steps: centre questions alone after the opening (--centre-first: after the text steps),
    # every other phase as without them
    phases = dict(total_samples=2000, seed=0, smoke=False, text_samples=8, opening_samples=12, existence_group=1)
    plain = _stream_rows(train_shapes.ShapesStream(**phases), 60)
    for first, start in ((False, 20), (True, 8)):
        led = list(itertools.islice(iter(train_shapes.ShapesStream(**phases, centre_samples=16, centre_first=first)), 76))
        centre_rows = [i for i, r in enumerate(led) if "centre of the image" in r["messages"][0]["content"][-1]["text"]]
        assert centre_rows == list(range(start, start + 16))
        assert _stream_rows(iter(led[:start] + led[start + 16:]), 60) == plain
    # --centre-mixed: the same steps, every other slot an opening task in turn (one sample a slot with
    # centre_group 1), on full scenes and never as text, as in the opening
    opening = ("colour", "existence", "count")
    mixed = list(itertools.islice(iter(train_shapes.ShapesStream(**phases, opening_tasks=opening, centre_samples=24,
                                                                  centre_mixed=24, centre_group=1)), 84))
    asked = [r["messages"][0]["content"][-1]["text"] for r in mixed[20:44]]
    assert ["centre of the image" in q for q in asked] == [True, False] * 12
    answers = [r["messages"][1]["content"][0]["text"] for r in mixed[21:44:2]]  # colour, existence, count in turn
    assert all(a in COLOURS for a in answers[0::3]) and set(answers[1::3]) <= {"yes", "no"}
    assert all(a in map(str, range(1, 6)) for a in answers[2::3])
    assert _stream_rows(iter(mixed[:20] + mixed[44:]), 60) == plain
    texted = itertools.islice(iter(train_shapes.ShapesStream(**{**phases, "existence_group": 2}, text_every=1,
                                                              opening_tasks=opening, centre_samples=24, centre_mixed=24)), 20, 44)
    assert all(r["messages"][0]["content"][0]["type"] == "image" for r in texted)
    # --centre-mixed-steps: only the last ones mixed, centre alone before them
    late = list(itertools.islice(iter(train_shapes.ShapesStream(**phases, opening_tasks=opening, centre_samples=24,
                                                                 centre_mixed=10, centre_group=1)), 84))
    asked = [r["messages"][0]["content"][-1]["text"] for r in late[20:44]]
    assert ["centre of the image" in q for q in asked] == [True] * 14 + [True, False] * 5
    assert [r["messages"][1]["content"][0]["text"] in COLOURS for r in late[35:44:2]] == [True, False, False, True, False]
    assert _stream_rows(iter(late[:20] + late[44:]), 60) == plain
    with pytest.raises(ValueError, match="centre_mixed is 30 samples, not between 0 and the 24 centre samples"):
        train_shapes.ShapesStream(**phases, centre_samples=24, centre_mixed=30)
    with pytest.raises(ValueError, match="tasks spelling are neither ShapesWorld tasks"):
        train_shapes.ShapesStream(**{**kwargs, "tasks": ("colour", "spelling")})
    # with follow-ups, a centre question opens a conversation like any other
    talks = itertools.islice(iter(train_shapes.ShapesStream(**kwargs, followups=2)), 8)
    talk = next(r for r in talks if "centre of the image" in r["messages"][0]["content"][-1]["text"])
    roles = [m["role"] for m in talk["messages"]]
    assert len(roles) >= 4 and roles == ["user", "assistant"] * (len(roles) // 2)  # follow-ups from --tasks' colour


def test_train_shapes_stream_asks_followups_about_the_same_image():
    train_shapes = load_example("train_shapes")
    kwargs = dict(total_samples=2400, seed=0, smoke=False, text_samples=48, text_every=4)
    plain = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs)), 400))
    talks = list(itertools.islice(iter(train_shapes.ShapesStream(**kwargs, followups=3)), 400))
    one_word = {*map(str, range(9)), *COLOURS, "yes", "no"}
    lengths = Counter()
    for index, (single, talk) in enumerate(zip(plain, talks)):
        messages = talk["messages"]
        assert messages[:2] == single["messages"]  # the first turn is the sample the evaluation asks
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        followups = (len(messages) - 2) // 2
        lengths[followups] += 1
        is_video = messages[0]["content"][0]["type"] == "video"
        assert followups == (0 if is_video else 3) or not is_video and 1 <= followups < 3
        for user, assistant in zip(messages[2::2], messages[3::2]):
            assert [c["type"] for c in user["content"]] == ["text"]  # the image is shown once
            # the text warm-up and the first curriculum level (the first 25% of image samples) ask only
            # one-word tasks; the warm-up only ones its caption answers
            if index < 48 + 600:
                assert assistant["content"][0]["text"] in one_word
    assert lengths[3] >= 300


def test_probe_text_matching_sorts_truths_and_runs(tmp_path):
    probe = load_example("probe_text_matching")
    validation = probe.validation_questions(24)
    for sample in validation[1]:
        (shape,) = sample["scene"]["shapes"]
        asked = (sample["query"]["colour"], sample["query"]["kind"])
        expected = {(True, True): "yes", (True, False): "no_kind_changed", (False, True): "no_colour_changed"}
        assert probe.truth_kind(sample) == expected[(asked[0] == shape["colour"], asked[1] == shape["kind"])]
    assert {probe.truth_kind(s) for s in validation[3]} == {"yes", "no_both"}  # a 3-shape "no" holds both halves
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "probe_text_matching.py"), "--smoke",
                             "--steps", "4", "--eval-every", "2", "--per-count", "8", "--json", str(tmp_path / "curve.json")],
                            capture_output=True, text=True, timeout=300, env=OFFLINE_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "curve.json").read_text())
    assert log["group"] == 4 and [row["step"] for row in log["curve"]] == [2, 4]
    assert all(0.0 <= row[key] <= 1.0 for row in log["curve"] for key in ("1_shapes", "3_shapes", "1_shapes/yes"))


def test_ideal_tower_gives_each_cell_its_shapes_name_embeddings(tiny_tokenizer):
    probe = load_example("probe_ideal_tower")
    from vlmkit.data import make_sample
    from vlmkit.data.shapes import cell_labels

    embed = torch.nn.Embedding(len(tiny_tokenizer), 16)
    tower = probe.IdealTower(embed, tiny_tokenizer)
    scenes = [make_sample(seed, task="caption", min_shapes=3, max_shapes=3)["scene"] for seed in (0, 1)]
    tower.scenes = list(scenes)
    tokens = tower(torch.zeros(1), torch.zeros(2, 3)).pooler_output
    cells = [cell_labels(scene) for scene in scenes]
    assert tokens.shape == (sum(c["kind"].size for c in cells), 16) and tower.scenes == []
    kind = torch.cat([torch.from_numpy(c["kind"]).flatten() for c in cells])
    colour = torch.cat([torch.from_numpy(c["colour"]).flatten() for c in cells])
    centre = torch.cat([torch.from_numpy(c["centre"]).flatten() for c in cells]).bool()
    assert int(centre.sum()) == 6  # three shapes in each image
    names = embed(tower.kind_ids[kind.clamp(max=len(KINDS) - 1)]) + embed(tower.colour_ids[colour.clamp(max=len(COLOURS) - 1)])
    expected = torch.where((kind < len(KINDS))[:, None], names, tower.background) + centre[:, None] * tower.centre
    assert (kind < len(KINDS)).any() and (kind == len(KINDS)).any()
    assert torch.allclose(tokens, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="3 images in the batch but 0 scenes queued"):
        tower(torch.zeros(1), torch.zeros(3, 3))


def test_ideal_tower_features_add_the_structured_extras_of_each_cell(tiny_tokenizer):
    probe = load_example("probe_ideal_tower")
    from vlmkit.data import make_sample
    from vlmkit.data.shapes import cell_attributes

    torch.manual_seed(0)
    embed = torch.nn.Embedding(len(tiny_tokenizer), 16)
    plain, structured = (probe.IdealTower(embed, tiny_tokenizer, features=f) for f in ((), ("count", "layout")))
    structured.load_state_dict(plain.state_dict(), strict=False)  # same background and centre vectors
    scenes = [make_sample(seed, task="caption", min_shapes=2, max_shapes=4)["scene"] for seed in (3, 4)]
    plain.scenes, structured.scenes = list(scenes), list(scenes)
    base = plain(torch.zeros(1), torch.zeros(2, 3)).pooler_output
    tokens = structured(torch.zeros(1), torch.zeros(2, 3)).pooler_output
    cells = [cell_attributes(scene) for scene in scenes]
    extras = structured.extras
    expected = base.clone()
    for name in ("total", "colour_count", "kind_count", "size", "rank", "background_type"):
        expected += extras[name](torch.cat([torch.from_numpy(c[name]).flatten() for c in cells]))
    for name in ("where", "place"):
        expected += extras[name](torch.cat([torch.from_numpy(c[name]).reshape(-1, 2) for c in cells]).float())
    digits = torch.cat([torch.from_numpy(c["box_digits"]).reshape(-1, 12) for c in cells])  # (N, 12)
    expected += sum(extras["box_digits"].rows.weight[12 * slot + digits[:, slot]] for slot in range(12))
    assert sorted(extras) == ["background_type", "box_digits", "colour_count", "kind_count", "place", "rank", "size", "total",
                              "where"]
    assert torch.allclose(tokens, expected, atol=1e-6) and not torch.allclose(tokens, base, atol=1e-3)
    with pytest.raises(ValueError, match=r"unknown feature\(s\) \['colour'\]; choose from count, layout, total, "):
        probe.IdealTower(embed, tiny_tokenizer, features=("count", "colour"))
    # every extra starts at about a name's norm, so that none buries the names (where's default nn.Linear
    # init was 15-18 times as large)
    name_norm = embed.weight.norm(dim=-1).mean()
    for name, value in (("where", torch.tensor([[1.0, 0.0]])), ("place", torch.tensor([[0.5, 0.0]])),
                        ("box_digits", digits[:1]), ("rank", torch.tensor([1]))):
        assert 0.5 < extras[name](value).norm() / name_norm < 2, name
    # --feature-scale starts the extras smaller; feature_norms tracks the tables against the names' rows
    assert set(structured.feature_norms()) == {f"norm_{name}" for name in ("total", "colour_count", "kind_count", "size",
                                                                          "rank", "background_type")}
    small = probe.IdealTower(embed, tiny_tokenizer, features=("total", "where"), feature_scale=0.1)
    assert 0.7 < structured.feature_norms()["norm_total"] < 1.4
    assert 0.07 < small.feature_norms()["norm_total"] < 0.14 and list(small.feature_norms()) == ["norm_total"]
    assert 0.05 < small.extras["where"](torch.tensor([[1.0, 0.0]])).norm() / name_norm < 0.2
    # single attributes and groups mix; each attribute is added once
    assert list(probe.IdealTower(embed, tiny_tokenizer, features=("where",)).extras) == ["where"]
    assert list(probe.IdealTower(embed, tiny_tokenizer, features=("kind_count", "count")).extras) == [
        "kind_count", "total", "colour_count"]


def test_probe_ideal_tower_keeps_the_task_mix_with_minimal_pairs_and_runs(tmp_path, monkeypatch):
    probe = load_example("probe_ideal_tower")
    single, grouped = probe.training_samples(3, 32, 1, (1, 5)), probe.training_samples(3, 32, 8, (1, 5))
    assert [s["task"] for s in single] == [s["task"] for s in grouped] == [probe.TASKS[i % 3] for i in range(32)]
    first_group = [s for s in grouped if s["task"] == "existence"][:8]
    assert sorted(s["answer"] for s in first_group) == ["no"] * 4 + ["yes"] * 4
    assert len({str(s["scene"]) for s in first_group}) == 1  # eight questions about one scene
    # position in groups: two scenes of eight questions, each pair of shapes asked both ways
    positions = probe.training_samples(3, 16, 1, (2, 5), ("position",), position_group=8)
    assert [len({str(s["scene"]) for s in positions[i:i + 8]}) for i in (0, 8)] == [1, 1]
    assert positions[0]["scene"] != positions[8]["scene"]
    # count in groups: eight count questions about one scene, with a "0" among them; the mix unchanged
    counted = probe.training_samples(3, 32, 8, (1, 5), count_group=8)
    assert [s["task"] for s in counted] == [s["task"] for s in single]
    first_counts = [s for s in counted if s["task"] == "count"][:8]
    assert len({str(s["scene"]) for s in first_counts}) == 1 and "0" in {s["answer"] for s in first_counts}
    order = {(s["query"]["a"]["kind"], s["query"]["a"]["colour"], s["query"]["b"]["kind"], s["query"]["b"]["colour"])
             for s in positions[:8]}
    assert all((bk, bc, ak, ac) in order for ak, ac, bk, bc in order)
    # one phrasing: the same two shapes, the same answer, template 0's words; other tasks untouched
    from vlmkit.data.shapesworld import TEMPLATES
    mixed = [*single[:4], *positions]
    reworded = [probe.one_template(s, 0) for s in mixed]
    assert sum(s["task"] == "position" for s in mixed) == 16
    for before, after in zip(mixed, reworded):
        if before["task"] != "position":
            assert after is before
            continue
        a, b = (f"{before['query'][k]['colour']} {before['query'][k]['kind']}" for k in ("a", "b"))
        assert after["question"] == f"Where is the {a} relative to the {b}?" == TEMPLATES["position"][0].format(a=a, b=b)
        assert after["answer"] == before["answer"] and after["scene"] is before["scene"]
    # centre questions: up to four about each scene (none twice about one shape), in the position
    # templates, so one phrasing applies to them too
    centres = probe.training_samples(3, 16, 1, (1, 5), ("colour", probe.CENTRE))
    centre_qs = [s for s in centres if s["query"].get("b") == "centre of the image"]
    assert [s["task"] for s in centres] == ["colour", "centre"] * 8 and len(centre_qs) == 8
    by_scene = Counter(str(s["scene"]) for s in centre_qs)
    assert max(by_scene.values()) <= 4 and len(by_scene) >= 2
    assert len({(str(s["scene"]), s["query"]["a"]["colour"], s["query"]["a"]["kind"]) for s in centre_qs}) == 8
    a = f"{centre_qs[0]['query']['a']['colour']} {centre_qs[0]['query']['a']['kind']}"
    assert probe.one_template(centre_qs[0], 0)["question"] == f"Where is the {a} relative to the centre of the image?"
    # the kind precursor: one question per slot, a shape named by its colour, its kind the answer
    kinds = probe.training_samples(3, 8, 1, (1, 5), ("colour", "kind"))
    assert [s["task"] for s in kinds] == ["colour", "kind"] * 4
    for sample in kinds[1::2]:
        named = [shape for shape in sample["scene"]["shapes"] if shape["colour"] in sample["question"]]
        assert len(named) == 1 and sample["answer"] == named[0]["kind"], sample["question"]
    logs = {}
    # the second stage1 run loads the stage-1 model the first one cached
    for run, tower in enumerate(("ideal", "stage1", "stage1")):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "probe_ideal_tower.py"), "--smoke",
                                 "--tower", tower, "--vision-steps", "2", "--stage1-cache", str(tmp_path / "stage1.pt"),
                                 "--batch-size", "6", "--steps", "2", "--eval-every", "1", "--per-count", "2",
                                 "--json", str(tmp_path / f"{run}.json"), *(["--question-first"] if run == 0 else [])],
                                capture_output=True, text=True, timeout=300, env=OFFLINE_ENV)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ('"vision"' in result.stdout) == (run == 1)  # stage 1 trained once
        logs[run] = json.loads((tmp_path / f"{run}.json").read_text())
        assert logs[run]["tower"] == tower and logs[run]["question_first"] == (run == 0) and [row["step"] for row in logs[run]["curve"]] == [1, 2]
        assert all(0.0 <= row[f"{task}/{n}"] <= 1.0 for row in logs[run]["curve"] for task in probe.TASKS for n in (1, 3, 5))
        # count also by what its questions name: each variant's score bounds the task's, which mixes them
        for row, n in ((row, n) for row in logs[run]["curve"] for n in probe.SHAPE_COUNTS):
            by_variant = {k.split("/")[0].removeprefix("count_"): v for k, v in row.items() if k.startswith("count_") and k.endswith(f"/{n}")}
            assert by_variant and set(by_variant) <= set(COUNT_VARIANTS)
            assert min(by_variant.values()) <= row[f"count/{n}"] <= max(by_variant.values())
    assert logs[0]["vision_curve"] == [] and len(logs[1]["vision_curve"]) == 2
    assert logs[2]["vision_curve"] == logs[1]["vision_curve"]
    # structured extras and other tasks; grounding is scored as the mean IoU of greedy boxes
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "probe_ideal_tower.py"), "--smoke",
                             "--features", "count,layout", "--tasks", "position,grounding,centre", "--batch-size", "6",
                             "--position-group", "2", "--position-template", "0", "--then", "1:centre,existence,kind",
                             "--feature-scale", "0.5", "--frozen-features", "--word-tokenizer",
                             "--steps", "1", "--eval-every", "1", "--per-count", "2", "--json", str(tmp_path / "f.json")],
                            capture_output=True, text=True, timeout=300, env=OFFLINE_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "f.json").read_text())
    assert log["features"] == list(probe.FEATURES) and log["tasks"] == ["position", "grounding", "centre"]
    assert (log["position_group"], log["position_template"], log["then"]) == (2, 0, "1:centre,existence,kind")
    assert (log["feature_scale"], log["frozen_features"], log["word_tokenizer"]) == (0.5, True, True)
    # every task of both phases scored, and each learned table's norm against the names' rows
    norms = {key: value for key, value in log["curve"][0].items() if key.startswith("norm_")}
    assert sorted(set(log["curve"][0]) - set(norms)) == sorted(
        ["step", "minutes", "loss"] + [f"{task}/{n}" for task in ("position", "grounding", "centre", "existence", "kind")
                                       for n in probe.SHAPE_COUNTS])
    assert sorted(norms) == sorted(f"norm_{name}" for name in ("total", "colour_count", "kind_count", "size", "rank",
                                                               "background_type"))
    assert all(0.3 < value < 0.8 for value in norms.values()), norms
    # the extras' options without extras: an error before anything is built
    monkeypatch.setattr(sys, "argv", ["probe_ideal_tower.py", "--smoke", "--frozen-features"])
    with pytest.raises(ValueError, match="--feature-scale and --frozen-features set the --features extras: name some"):
        probe.main()


def test_length_sorted_steps_keep_each_steps_samples_and_sort_them_by_processed_length(tiny_tokenizer):
    train_shapes = load_example("train_shapes")
    _, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    collator = VLMKitDataCollator(processor)
    tasks = ("caption", "count", "colour", "grounding", "motion")
    stream = train_shapes.ShapesStream(32 * 40, 0, False, tasks)
    sorted_steps = train_shapes.LengthSortedSteps(stream, 8, processor)
    plain, reordered = list(itertools.islice(stream, 32)), list(itertools.islice(sorted_steps, 32))
    text = lambda sample: repr([[p.get("text") for p in m["content"]] for m in sample["messages"]])  # noqa: E731
    processed = [collator([sample])["input_ids"].shape[1] for sample in reordered]
    for step in range(4):
        rows = slice(8 * step, 8 * step + 8)
        assert sorted(map(text, plain[rows])) == sorted(map(text, reordered[rows]))
        assert processed[rows] == sorted(processed[rows]), processed[rows]
    # the estimate is the processed length less the chat template's tokens, which are fixed per kind of
    # input while clips keep one length (the curriculum's first level: 4 frames)
    overhead = {}
    for sample, length in zip(reordered, processed):
        overhead.setdefault(sample["messages"][0]["content"][0]["type"], set()).add(length - sorted_steps.length(sample))
    assert set(overhead) == {"image", "video"} and all(len(values) == 1 for values in overhead.values()), overhead


def test_length_sorted_steps_count_a_clips_frames_in_whole_pairs(tiny_tokenizer):
    # clips of 4-8 frames: the processor pads an odd count to whole frame pairs, so 5 frames cost what 6
    # do, and only the template's "<t seconds>" stamps (one per pair) are left out of the estimate
    from vlmkit.data import make_sample
    from vlmkit.data.shapesworld import as_messages
    train_shapes = load_example("train_shapes")
    _, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    collator, sorter = VLMKitDataCollator(processor), train_shapes.LengthSortedSteps(None, 8, processor)
    left_out = {}
    for seed in range(12):
        clip = make_sample(seed, task="motion", difficulty=2)
        sample = {"messages": as_messages(clip), "fps": clip["fps"]}
        pairs = (len(clip["video"]) + 1) // 2
        left_out.setdefault(pairs, set()).add(collator([sample])["input_ids"].shape[1] - sorter.length(sample))
    assert len(left_out) >= 3 and all(len(values) == 1 for values in left_out.values()), left_out


def test_micro_batches_train_the_step_a_whole_batch_trains(tiny_tokenizer):
    """One AdamW step over 8 samples, whole or in 2 length-sorted micro-batches: the same logged loss (not
    twice it: the Trainer divides the per-sample means) and the same weights after."""
    train_shapes = load_example("train_shapes")
    runs = []
    for micro_batches in (1, 2):
        torch.manual_seed(0)
        model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
        args = SimpleNamespace(batch_size=8, micro_batches=micro_batches, seed=0, adam_beta2=0.95, loss="sample",
                               vision_lr_scale=1.0, deepstack_lr_scale=1.0, frame_difference_lr_scale=0.0)
        stream = train_shapes.ShapesStream(8, 0, True, ("caption", "count", "colour", "grounding"))
        losses = []

        class LossLog(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                losses.extend([logs["loss"]] if "loss" in logs else [])

        train_shapes.train_language_model(model, VLMKitDataCollator(processor), stream, args, 1, 1e-3, 0,
                                          "constant_with_warmup", LossLog())
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (losses_whole, weights_whole), (losses_micro, weights_micro) = runs
    assert len(losses_whole) == 1 and losses_micro == pytest.approx(losses_whole, rel=1e-4)
    for name, weight in weights_whole.items():
        torch.testing.assert_close(weights_micro[name], weight, atol=2e-5, rtol=1e-4, msg=name)


def test_colour_word_swap_changes_the_inputs_colour_before_each_answer_kind_and_keeps_the_labels(tiny_tokenizer):
    train_shapes = load_example("train_shapes")
    processor = VLMKitProcessor.from_pretrained(default_model_path())  # one token per colour
    collator = VLMKitDataCollator(processor)
    # captions of 1-5 shapes, and questions whose colour-kind pair is in the question, not the answer
    samples = [make_sample(seed, task=task) for seed in range(12) for task in ("caption", "existence", "colour")]
    rows = [{"messages": as_messages(s), "fps": s["fps"]} for s in samples]
    plain = collator(rows)
    assert torch.equal(train_shapes.ColourWordSwap(collator, 0.0, 0)(rows)["input_ids"], plain["input_ids"])
    swapped = train_shapes.ColourWordSwap(collator, 1.0, 0)(rows)
    assert torch.equal(swapped["labels"], plain["labels"]) and torch.equal(swapped["attention_mask"], plain["attention_mask"])
    tokenizer, colour_words = processor.tokenizer, {" " + c for c in COLOURS}
    for row, sample in enumerate(samples):
        changed = (swapped["input_ids"][row] != plain["input_ids"][row]).nonzero().flatten().tolist()
        if sample["task"] != "caption":
            assert changed == [], sample["task"]
            continue
        # every shape's colour word, and nothing else, reads another palette colour
        assert len(changed) == len(sample["scene"]["shapes"]), sample["answer"]
        for position in changed:
            before, after = (tokenizer.decode([int(ids[row, position])]) for ids in (plain["input_ids"], swapped["input_ids"]))
            assert before in colour_words and after in colour_words and before != after
            assert tokenizer.decode([int(plain["input_ids"][row, position + 1])]).strip() in KINDS
    # with max_pairs, captions of more shapes keep every colour word; the others are swapped as before
    one_shape = train_shapes.ColourWordSwap(collator, 1.0, 0, max_pairs=1)(rows)["input_ids"] != plain["input_ids"]
    shapes = [len(s["scene"]["shapes"]) if s["task"] == "caption" else 0 for s in samples]
    assert 1 in shapes and max(shapes) > 1, shapes
    assert one_shape.sum(1).tolist() == [int(n == 1) for n in shapes]
    # a share swaps about that share of them, each colour to each other colour about equally often
    halves, palette = train_shapes.ColourWordSwap(collator, 0.5, 1), [tokenizer.convert_tokens_to_ids("Ġ" + c) for c in COLOURS]
    colour_words_in_captions = sum(len(s["scene"]["shapes"]) for s in samples if s["task"] == "caption")
    shifts = Counter()
    for _ in range(20):
        inputs = halves(rows)["input_ids"]
        changed = inputs != plain["input_ids"]
        shifts.update((palette.index(int(a)) - palette.index(int(b))) % len(COLOURS)
                      for a, b in zip(inputs[changed], plain["input_ids"][changed]))
    assert 0.45 < shifts.total() / (20 * colour_words_in_captions) < 0.55, (shifts.total(), colour_words_in_captions)
    assert set(shifts) == set(range(1, len(COLOURS)))
    assert all(abs(n / shifts.total() - 1 / (len(COLOURS) - 1)) < 0.05 for n in shifts.values()), shifts
    _, tiny = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    with pytest.raises(ValueError, match='the tokenizer splits " [a-z]+" into [2-9]'):
        train_shapes.ColourWordSwap(VLMKitDataCollator(tiny), 0.5, 0)


@pytest.mark.parametrize("tower_scale, deepstack_scale", [(0.0, 1.0), (0.3, 0.3), (0.1, 0.0)])
def test_train_shapes_stage_2_groups_scale_the_tower_and_the_deepstack_mergers_apart(
        tiny_tokenizer, tower_scale, deepstack_scale):
    train_shapes = load_example("train_shapes")
    model, _ = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    groups = train_shapes.stage_2_param_groups(model, lr=1e-3, vision_lr_scale=tower_scale,
                                               deepstack_lr_scale=deepstack_scale)
    names = {id(p): n for n, p in model.named_parameters()}
    deepstack = {n for n in names.values() if ".deepstack_merger_list." in n}
    tower = {n for n in names.values() if n.startswith("model.visual.")} - deepstack
    text = set(names.values()) - tower - deepstack
    assert deepstack and tower and text
    rate = {n: 1e-3 for n in text} | {n: 1e-3 * tower_scale for n in tower} | {n: 1e-3 * deepstack_scale for n in deepstack}
    grouped = {names[id(p)]: group["lr"] for group in groups for p in group["params"]}
    assert grouped == pytest.approx({n: r for n, r in rate.items() if r})  # frozen parts are in no group
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == (tower if tower_scale == 0 else set()) | (deepstack if deepstack_scale == 0 else set())


def test_frame_difference_training_changes_clips_and_leaves_stills_as_they_were(tiny_tokenizer):
    from vlmkit.data import make_sample

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    groups = train_shapes.stage_2_param_groups(model, lr=1e-2, vision_lr_scale=0.0, deepstack_lr_scale=1.0,
                                               frame_difference_lr_scale=1.0)
    weight = model.get_parameter(train_shapes.PATCH_EMBED_WEIGHT)
    trainable_visual = {n for n, p in model.named_parameters() if n.startswith("model.visual.") and p.requires_grad}
    assert trainable_visual - {train_shapes.PATCH_EMBED_WEIGHT} == {
        n for n in trainable_visual if ".deepstack_merger_list." in n}
    assert [g["weight_decay"] for g in groups if g["params"] == [weight]] == [0.0]
    image = processor.image_processor(images=[make_sample(0, task="colour")["image"]], return_tensors="pt")
    clip = processor.video_processor(videos=[make_sample(6, task="motion")["video"]], return_tensors="pt",
                                     video_metadata=[{"fps": 2.0}])
    visual = model.model.visual

    def tokens(inputs, pixels, grid):
        return visual(inputs[pixels], inputs[grid]).pooler_output

    seen_by_stills, difference = weight.detach().sum(2).clone(), weight.detach().diff(dim=2).clone()
    still_before, clip_before = tokens(image, "pixel_values", "image_grid_thw"), tokens(clip, "pixel_values_videos", "video_grid_thw")
    optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    for _ in range(3):  # the loss reaches the patch embedding through the frozen tower, from the still and the clip
        loss = tokens(image, "pixel_values", "image_grid_thw").square().sum() + tokens(clip, "pixel_values_videos", "video_grid_thw").sum()
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
    with torch.no_grad():
        # up to float rounding: (w0 - u) + (w1 + u) need not round to w0 + w1
        torch.testing.assert_close(tokens(image, "pixel_values", "image_grid_thw"), still_before.detach(), rtol=0, atol=1e-6)
        assert (tokens(clip, "pixel_values_videos", "video_grid_thw") - clip_before).abs().max() > 1e-2
        # what stills see (the sum over the temporal patch) did not move; the difference did
        torch.testing.assert_close(weight.sum(2), seen_by_stills, rtol=0, atol=1e-6)
        assert (weight.diff(dim=2) - difference).abs().max() > 1e-3
def test_structured_stage_1_labels_every_token_with_cell_attributes(tiny_tokenizer):
    from vlmkit.data import make_sample
    from vlmkit.data.shapes import cell_attributes, cell_labels

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    seeds = [3, 4, 5]
    everything = train_shapes.structured_heads("count,layout")  # the linear heads; "all" adds the word-scored ones
    assert everything == (*train_shapes.STRUCTURED_HEADS, "box_digits", "where", "place")
    assert train_shapes.structured_heads("all") == (*everything, "background_word", "background_word_colour", "size_word")
    plain = train_shapes.dense_batch(processor, seeds)
    pixels, grid, labels = train_shapes.dense_batch(processor, seeds, structured=everything)
    assert torch.equal(pixels, plain[0]) and torch.equal(labels[:, :3], plain[2]) and labels.shape[1] == 3 + 6 + 12 + 2
    # the same samples as dense_batch draws them: row-major cells, image after image
    scenes = [make_sample(seed, task=train_shapes.IMAGE_TASKS[seed % 6], difficulty=seed // 6 % 3)["scene"] for seed in seeds]
    cells = [cell_attributes(scene) for scene in scenes]
    assert sum(cell_labels(scene)["kind"].size for scene in scenes) == len(labels)
    for i, name in enumerate(train_shapes.STRUCTURED_HEADS):
        assert labels[:, 3 + i].tolist() == [v for c in cells for v in c[name].flatten().tolist()], name
    assert labels[:, 9:21].tolist() == [row for c in cells for row in c["box_digits"].reshape(-1, 12).tolist()]
    # where: the cell's centre in permille of the image's width and height, x first
    assert labels[:, 21:].tolist() == [[round(1000 * x), round(1000 * y)] for c in cells for x, y in c["where"].reshape(-1, 2).tolist()]
    first = cells[0]["where"].shape[:2]  # (rows, cols) of the first image: its top-left and bottom-right cells
    assert labels[0, 21:].tolist() == [round(500 / first[1]), round(500 / first[0])]
    assert labels[first[0] * first[1] - 1, 21:].tolist() == [1000 - round(500 / first[1]), 1000 - round(500 / first[0])]
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=everything)
    loss, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in heads.structured.parameters())
    assert sorted(accuracy) == sorted(["kind", "colour", "background", "centre", "kind_share", "colour_share",
                                       *train_shapes.STRUCTURED_HEADS, "box_hundreds",
                                       "where", "place"])
    # one group or one head alone: only its columns and its heads
    assert train_shapes.structured_heads("where,count") == ("total", "colour_count", "kind_count", "where")
    _, _, few = train_shapes.dense_batch(processor, seeds, structured=("kind_count", "where"))
    assert torch.equal(few, labels[:, [0, 1, 2, 5, 21, 22]])
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=("kind_count", "where"))
    _, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, few)
    assert sorted(accuracy) == ["background", "centre", "colour", "colour_share", "kind", "kind_count", "kind_share", "where"]
    # place reads where's columns: alone it brings them, with where it shares them
    assert torch.equal(train_shapes.dense_batch(processor, seeds, structured=("place",))[2], labels[:, [0, 1, 2, 21, 22]])
    assert torch.equal(train_shapes.dense_batch(processor, seeds, structured=("where", "place"))[2], labels[:, [0, 1, 2, 21, 22]])
    with pytest.raises(ValueError, match=r"unknown structured head\(s\) \['places'\]; choose from count, layout, all, total"):
        train_shapes.structured_heads("count,places")


def test_word_heads_score_background_type_and_size_against_their_words(tiny_tokenizer):
    from vlmkit.data.shapes import BACKGROUNDS, SIZES, cell_attributes

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    words = ("background_word", "size_word")
    seeds = [6, 12, 15, 16, 17]  # a clip (seed 6), then stills on every curriculum level
    samples = train_shapes.dense_samples(seeds, motion=True)
    samples = samples[1:] + samples[:1]  # dense_labels puts the stills' tokens first, then the clips'
    types = [s["scene"]["background"]["type"] for s in samples]
    assert samples[-1]["video"] is not None and len(set(types)) >= 2  # more than one background type shown
    pixels, grid, plain = train_shapes.dense_batch(processor, seeds, motion=True)
    _, _, labels = train_shapes.dense_batch(processor, seeds, structured=words, motion=True)
    assert labels.shape[1] == plain.shape[1] + 1  # size_word's column; background_word relabels kind's
    cells = [int(g.prod()) // 4 for g in grid]  # tokens of each sample
    owner = torch.repeat_interleave(torch.arange(len(seeds)), torch.tensor(cells))
    type_index = torch.tensor([BACKGROUNDS.index(t) for t in types])[owner]
    background = plain[:, 0] == len(KINDS)
    assert torch.equal(labels[:, 0], torch.where(background, len(KINDS) + type_index, plain[:, 0]))
    assert torch.equal(labels[:, 1:4], plain[:, 1:4])
    # size_word: small 0 / large 1 on the stills' shape cells, -100 on background and on the clip
    sizes = [cell_attributes(s["scene"])["size"].flatten() for s in samples[:-1]]
    expected = torch.from_numpy(np.concatenate(sizes))
    expected = torch.where(expected < len(SIZES), expected, -100)
    stills = sum(cells[:-1])
    assert torch.equal(labels[:stills, 4], expected) and (labels[stills:, 4] == -100).all()
    assert set(labels[:, 4].tolist()) == {-100, 0, 1}

    embed = model.get_input_embeddings()
    heads = train_shapes.NameHeads(embed, tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=words, motion=True)
    assert sorted(heads.background) == ["colour", "motion"] and len(heads.structured) == 0
    tokens = model.model.visual(pixels, grid).pooler_output
    logits = heads(tokens)
    assert logits["kind"].shape == (len(tokens), len(KINDS) + len(BACKGROUNDS)) and logits["size_word"].shape == (len(tokens), 2)
    # the classes are the words' own embeddings: a token equal to " striped"'s row is scored striped
    striped = embed.weight[train_shapes.name_token_ids(tiny_tokenizer, ["striped"])[0]].mean(0)
    assert heads(striped[None])["kind"].argmax().item() == len(KINDS) + BACKGROUNDS.index("striped")
    loss, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    plain_heads = train_shapes.NameHeads(embed, tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                         structured=("background_word",), motion=True)
    plain_heads.load_state_dict(heads.state_dict())
    without = train_shapes.dense_scores(model.model.visual, plain_heads, pixels, grid, labels[:, :4])[0]
    torch.testing.assert_close(loss - without, torch.nn.functional.cross_entropy(logits["size_word"], labels[:, 4]),
                               rtol=1e-4, atol=1e-5)
    hits = logits["kind"].argmax(-1) == labels[:, 0]
    assert accuracy["background"] == accuracy["background_word"] == hits[background].float().mean().item()
    assert accuracy["size_word"] == (logits["size_word"].argmax(-1) == labels[:, 4])[labels[:, 4] >= 0].float().mean().item()


def test_background_word_colour_names_the_background_by_the_colour_head(tiny_tokenizer):
    from vlmkit.data import COLOURS, KINDS
    from vlmkit.data.shapes import BACKGROUNDS

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    seeds = [12, 15, 16, 17]
    types = [s["scene"]["background"]["type"] for s in train_shapes.dense_samples(seeds)]
    pixels, grid, plain = train_shapes.dense_batch(processor, seeds)
    _, _, labels = train_shapes.dense_batch(processor, seeds, structured=("background_word_colour",))
    owner = torch.repeat_interleave(torch.arange(len(seeds)), grid.prod(-1) // 4)
    type_index = torch.tensor([BACKGROUNDS.index(t) for t in types])[owner]
    background = plain[:, 0] == len(KINDS)
    assert (plain[background, 1] == len(COLOURS)).all()
    # the kind head keeps its learned background class; the colour head's background cells name their type
    assert torch.equal(labels[:, 0], plain[:, 0]) and torch.equal(labels[:, 2], plain[:, 2])
    assert torch.equal(labels[:, 1], torch.where(background, len(COLOURS) + type_index, plain[:, 1]))
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=("background_word_colour",))
    assert sorted(heads.background) == ["kind"] and heads.background_named_by == ["colour"]
    _, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    logits = heads(model.model.visual(pixels, grid).pooler_output)
    assert logits["colour"].shape[1] == len(COLOURS) + len(BACKGROUNDS)
    assert accuracy["background_word"] == (logits["colour"].argmax(-1) == labels[:, 1])[background].float().mean().item()


def test_polish_curve_logger_asks_stage_2_questions_with_its_own_curve():
    train_shapes = load_example("train_shapes")
    stage_2 = train_shapes.CurveLogger(None, ("colour", "centre"), eval_every=5, per_task=2)
    assert [s["task"] for s in stage_2.samples] == ["colour", "colour", "centre", "centre"]
    stage_2.evals.append({"step": 5})
    polish = stage_2.restarted()
    assert polish.samples is stage_2.samples and polish.blank_samples is stage_2.blank_samples
    assert polish.eval_every == 5 and polish.evals == [] and polish.curve == [] and polish.start >= stage_2.start
    polish.evals.append({"step": 1})
    assert stage_2.evals == [{"step": 5}]


def test_opening_check_stops_the_run_only_below_the_bar_at_the_openings_end(monkeypatch):
    train_shapes = load_example("train_shapes")
    asked = []

    def five_of_eight_right(model, collator, samples, to_messages=None):
        asked.extend(samples)
        return torch.tensor([True] * 5 + [False] * 3)[:len(samples)]

    monkeypatch.setattr(train_shapes, "exact_match", five_of_eight_right)
    state, control = SimpleNamespace(global_step=5), SimpleNamespace(should_training_stop=False)
    at_bar = train_shapes.OpeningCheck(None, at_step=6, bar=0.625, per_task=8)
    assert [s["task"] for s in at_bar.samples] == ["existence"] * 8
    at_bar.on_step_end(None, state, control, model=None)
    assert at_bar.score is None and not at_bar.failed and asked == []  # not the opening's end yet
    state.global_step = 6
    at_bar.on_step_end(None, state, control, model=None)
    assert at_bar.score == 0.625 and not at_bar.failed and not control.should_training_stop
    assert asked == at_bar.samples
    above = train_shapes.OpeningCheck(None, at_step=6, bar=0.7, per_task=8)
    above.on_step_end(None, state, control, model=None)
    assert above.score == 0.625 and above.failed and control.should_training_stop


def test_exact_match_batched_scores_every_sample_once_in_batches_of_32(monkeypatch):
    train_shapes = load_example("train_shapes")
    batches = []

    def odd_ones_right(model, collator, samples, to_messages):
        batches.append((samples, to_messages))
        return torch.tensor([s % 2 == 1 for s in samples])

    monkeypatch.setattr(train_shapes, "exact_match", odd_ones_right)
    correct = train_shapes.exact_match_batched(None, None, list(range(70)), to_messages="described")
    assert [len(b) for b, _ in batches] == [32, 32, 6] and {m for _, m in batches} == {"described"}
    assert correct.tolist() == [i % 2 == 1 for i in range(70)]


def test_train_shapes_stream_asks_the_caption_precursors_background_and_size():
    train_shapes = load_example("train_shapes")
    rows = list(itertools.islice(iter(train_shapes.ShapesStream(
        total_samples=100_000, seed=0, smoke=False, tasks=("colour", "background", "size"), existence_group=1)), 300))
    answers = [r["messages"][1]["content"][0]["text"] for r in rows]
    # level 0's scenes are all plain, so it leaves background out: colour and size in turn
    assert all(a in COLOURS for a in answers[0::2]) and set(answers[1::2]) == {"small", "large"}
    assert all(r["messages"][0]["content"][0]["type"] == "image" for r in rows)
    late = [r for i, r in enumerate(itertools.islice(iter(train_shapes.ShapesStream(
        total_samples=900, seed=0, smoke=False, tasks=("colour", "background", "size"))), 900)) if i % 3 == 1][-50:]
    assert {r["messages"][1]["content"][0]["text"] for r in late} == {"plain", "striped", "checkered", "speckled"}
    # the validation probe asks them too, each shape named in full
    logger = train_shapes.CurveLogger(None, ("background", "size"), eval_every=5, per_task=3)
    assert [s["task"] for s in logger.samples] == ["background"] * 3 + ["size"] * 3
    assert all(s["question"].count(s["query"]["kind"]) == 1 for s in logger.samples[3:])


def test_train_shapes_stream_asks_the_kind_precursor_from_the_first_level():
    train_shapes = load_example("train_shapes")
    rows = list(itertools.islice(iter(train_shapes.ShapesStream(
        total_samples=100_000, seed=0, smoke=False, tasks=("colour", "kind"), existence_group=1)), 200))
    answers = [r["messages"][1]["content"][0]["text"] for r in rows]
    assert all(a in COLOURS for a in answers[0::2]) and set(answers[1::2]) == set(KINDS)
    questions = [r["messages"][0]["content"][1]["text"] for r in rows[1::2]]
    assert all(any(f" {c} " in f" {q[:-1]} " for c in COLOURS) for q in questions)
    logger = train_shapes.CurveLogger(None, ("kind",), eval_every=5, per_task=4)
    assert [s["task"] for s in logger.samples] == ["kind"] * 4 and all(s["answer"] in KINDS for s in logger.samples)


def test_a_task_listed_twice_gets_twice_the_slots_and_is_validated_once():
    train_shapes = load_example("train_shapes")
    tasks = ("colour", "count", "colour")
    rows = _stream_rows(train_shapes.ShapesStream(total_samples=300, seed=0, smoke=False, tasks=tasks), 300)
    count = sum(r["answer"].isdigit() for r in rows)  # colour answers are words
    assert count == 100 and len(rows) == 300
    logger = train_shapes.CurveLogger(None, tasks, eval_every=5, per_task=2)
    assert [s["task"] for s in logger.samples] == ["colour", "colour", "count", "count"]


def test_off_palette_fills_keep_clear_of_every_palette_hue():
    import colorsys

    import numpy as np

    train_shapes = load_example("train_shapes")
    rng = np.random.default_rng(0)
    fills = [train_shapes.off_palette_rgb(rng) for _ in range(2000)]
    greys = [f for f in fills if f[0] == f[1] == f[2]]
    assert 450 <= len(greys) <= 550 and min(g[0] for g in greys) >= 90 and max(g[0] for g in greys) <= 160

    def hue(rgb):  # degrees
        return colorsys.rgb_to_hsv(*(v / 255 for v in rgb))[0] * 360

    palette_hues = [hue(rgb) for name, rgb in COLOURS.items() if name != "black"]
    gaps = [min(abs(hue(f) - p) % 360, 360 - abs(hue(f) - p) % 360) for f in fills if f not in greys for p in palette_hues]
    assert min(gaps) > 20  # no red, orange, yellow, green, blue or purple shade: no held-out pair in any shade
    # dark enough to show on the light backgrounds (200-255 per channel)
    assert max(sum(f) / 3 for f in fills) < 170 and max(max(f) for f in fills) <= 204


def test_stage_1_recoloured_shapes_keep_their_kind_and_lose_their_colour_label(tiny_tokenizer):
    import numpy as np
    from vlmkit.data.shapes import cell_owners

    train_shapes = load_example("train_shapes")
    _, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    seeds = [3, 4, 5, 6, 7, 8]
    samples = train_shapes.dense_samples(seeds)
    rng = np.random.default_rng(seeds)
    mixed = [train_shapes.recoloured(s, 0.5, rng) for s in samples]
    off = [{i for i, shape in enumerate(m["scene"]["shapes"]) if "rgb" in shape} for m in mixed]
    assert sum(map(len, off)) == 4 and sum(len(s["scene"]["shapes"]) for s in samples) == 10  # about half
    assert train_shapes.recoloured(samples[0], 0.0, np.random.default_rng(0)) is samples[0]
    from vlmkit.data.shapes import content_hash
    assert all(m["hash"] == content_hash(m["image"]) != s["hash"] for m, s, o in zip(mixed, samples, off) if o)
    everything = train_shapes.recoloured(samples[0], 1.0, np.random.default_rng(0))
    assert all("rgb" in shape for shape in everything["scene"]["shapes"])
    # --recolour-kinds: another share for the kinds named (all their shapes here, no other), from the same draws
    kinds = {shape["kind"] for s in samples for shape in s["scene"]["shapes"]}
    named = sorted(kinds)[:2]
    by_kind = [train_shapes.recoloured(s, 0.0, np.random.default_rng(i), {k: 1.0 for k in named}) for i, s in enumerate(samples)]
    assert [[("rgb" in shape) == (shape["kind"] in named) for shape in m["scene"]["shapes"]] for m in by_kind] == [
        [True] * len(s["scene"]["shapes"]) for s in samples]
    assert sum("rgb" in shape for m in by_kind for shape in m["scene"]["shapes"]) >= 2
    rng = np.random.default_rng(seeds)
    assert [m["hash"] for m in (train_shapes.recoloured(s, 0.5, rng, {}) for s in samples)] == [m["hash"] for m in mixed]
    assert train_shapes.kind_shares("circle=0.9,hexagon=1") == {"circle": 0.9, "hexagon": 1.0} and train_shapes.kind_shares("") == {}
    for bad in ("circle=1.5", "oval=0.5", "circle"):
        with pytest.raises(ValueError, match=f"{bad!r} is not KIND=SHARE"):
            train_shapes.kind_shares(bad)
    structured = ("colour_count", "place")
    _, _, plain = train_shapes.dense_labels(processor, samples, structured)
    _, _, labels = train_shapes.dense_labels(processor, mixed, structured)
    owners = torch.cat([torch.from_numpy(cell_owners(s["scene"]).flatten()) for s in samples])
    image = torch.cat([torch.full((cell_owners(s["scene"]).size,), i) for i, s in enumerate(samples)])
    hidden = torch.tensor([o.item() in off[i.item()] for o, i in zip(owners, image)])
    shown = torch.tensor([bool(off[i.item()]) for i in image])  # cells of an image with a recoloured shape
    assert hidden.sum().item() == 8 and shown.sum().item() == 52
    # kind, centre and place as before; colour ignored (-100) on the recoloured shapes' cells only, and the
    # colour counts on every cell of their images
    assert torch.equal(labels[:, [0, 2, 4, 5]], plain[:, [0, 2, 4, 5]])
    assert torch.equal(labels[:, 1], torch.where(hidden, -100, plain[:, 1]))
    assert torch.equal(labels[:, 3], torch.where(shown, -100, plain[:, 3]))
    # dense_batch draws the same fills from its seeds
    pixels, _, batch = train_shapes.dense_batch(processor, seeds, structured=structured, recolour=0.5)
    assert torch.equal(batch, labels)
    assert torch.equal(pixels, train_shapes.dense_labels(processor, mixed, structured)[0])
    # the held-out pairs' scenes: validation scenes, each shape in its kind's held-out colour (diamonds keep theirs)
    heldout = train_shapes.heldout_pair_samples(seeds)
    validation = train_shapes.dense_samples(seeds, split="validation")
    pairs = [(s["colour"], s["kind"]) for sample in heldout for s in sample["scene"]["shapes"]]
    assert all(p in HELDOUT_COMBOS or p[1] == "diamond" for p in pairs) and len(pairs) == 11
    assert [[s["box"] for s in h["scene"]["shapes"]] for h in heldout] == [[s["box"] for s in v["scene"]["shapes"]] for v in validation]


def test_where_head_is_scored_as_a_normalised_squared_error_on_image_tokens(tiny_tokenizer):
    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=("where",), motion=True)
    pixels, grid, labels = train_shapes.dense_batch(processor, [5, 6], structured=("where",), motion=True)  # an image, a clip
    assert (labels[:, 4:] >= 0).sum() == 2 * int(grid[0, 1:].prod()) // 4  # the image's cells are labelled, the clip's -100
    with_where, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    tokens = model.model.visual(pixels, grid).pooler_output
    image = labels[:, 4] >= 0
    expected = 12 * (heads.structured["where"](tokens[image]) - labels[image, 4:].float() / 1000).pow(2).mean()
    plain = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   motion=True)
    plain.load_state_dict(heads.state_dict(), strict=False)  # the same name heads, without where
    without = train_shapes.dense_scores(model.model.visual, plain, pixels, grid, labels[:, :4])[0]
    assert 0 <= accuracy["where"] <= 1
    torch.testing.assert_close(with_where - without, expected, rtol=1e-4, atol=1e-5)


def test_place_head_regresses_the_offset_from_the_centre_on_shapes_and_zero_on_background(tiny_tokenizer):
    from vlmkit.data import KINDS

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    embed = model.get_input_embeddings()
    heads = train_shapes.NameHeads(embed, tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=("place",), motion=True)
    pixels, grid, labels = train_shapes.dense_batch(processor, [5, 6, 8], structured=("place",), motion=True)  # a clip at 6
    with_place, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    tokens = model.model.visual(pixels, grid).pooler_output
    image = labels[:, 4] >= 0
    shape = labels[:, 0] < len(KINDS)
    assert image.sum() < len(labels) and (image & shape).any() and (image & ~shape).any()
    target = (labels[:, 4:].float() / 1000 - 0.5) * shape[:, None]
    error = heads.structured["place"](tokens) - target
    expected = 12 * (error[image & shape].pow(2).mean() + error[image & ~shape].pow(2).mean())
    plain = train_shapes.NameHeads(embed, tiny_tokenizer, model.config.vision_config.out_hidden_size, motion=True)
    plain.load_state_dict(heads.state_dict(), strict=False)
    without = train_shapes.dense_scores(model.model.visual, plain, pixels, grid, labels[:, :4])[0]
    torch.testing.assert_close(with_place - without, expected, rtol=1e-4, atol=1e-5)
    assert accuracy["place"] == (error[image & shape].abs() < 0.1).all(-1).float().mean().item()
    # the head reads the cosine with its directions: the token's norm (left free by the names' cosine
    # scoring) does not scale the place, and a place of 1 is the direction itself
    head = heads.structured["place"]
    torch.testing.assert_close(head(3 * tokens), head(tokens))
    torch.testing.assert_close(head(5 * head.directions.detach())[0, 0], torch.tensor(1.0))
    assert head(tokens).abs().max() <= 1 + 1e-6


def test_cosine_count_heads_score_counts_by_the_tokens_direction_and_report_its_share(tiny_tokenizer):
    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    width = model.config.vision_config.out_hidden_size
    structured = train_shapes.structured_heads("place,count")
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, width, structured=structured,
                                   count_heads="cosine")
    linear = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, width, structured=structured)
    assert {n: type(h).__name__ for n, h in heads.structured.items()} == {
        "total": "CosineClassHead", "colour_count": "CosineClassHead", "kind_count": "CosineClassHead", "place": "PlaceHead"}
    assert all(type(linear.structured[n]) is torch.nn.Linear for n in train_shapes.COUNT_HEADS)
    seeds = [3, 4, 5, 12]
    pixels, grid, labels = train_shapes.dense_batch(processor, seeds, structured=structured)
    tokens = model.model.visual(pixels, grid).pooler_output
    total = heads.structured["total"]
    # a fixed temperature times the cosine: the token's norm changes nothing, and a token along
    # count 2's direction scores 2 at the temperature itself
    torch.testing.assert_close(total(7 * tokens), total(tokens))
    along = total(3 * total.directions.detach()[2:3])
    assert along.argmax().item() == 2 and along[0, 2].item() == pytest.approx(train_shapes.COUNT_TEMPERATURE, rel=1e-5)
    assert total(tokens).abs().max() <= train_shapes.COUNT_TEMPERATURE + 1e-4
    # plus a bias per count, which holds the prior at no cost to the token's direction
    with torch.no_grad():
        total.bias.copy_(torch.arange(6.0))
    torch.testing.assert_close(total(tokens) - torch.arange(6.0), total.temperature * total.cosines(tokens))
    # the share: the mean cosine of the right count's direction, over the cells the accuracy counts
    loss, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    loss.backward()
    assert all(h.directions.grad is not None for h in heads.structured.values())
    unit = torch.nn.functional.normalize
    shape = labels[:, 0] < len(KINDS)
    for i, name in enumerate(train_shapes.COUNT_HEADS):
        column = labels[:, 3 + i]
        cells = (column >= 0) if name == "total" else (column >= 0) & shape
        cosines = unit(tokens, dim=-1) @ unit(heads.structured[name].directions, dim=-1).T  # (N, counts)
        expected = cosines[cells].gather(1, column[cells][:, None]).mean().item()
        assert accuracy[f"{name}_share"] == pytest.approx(expected, abs=1e-6), name
    # and the names' share: the cosine of a shape token with its kind's word row
    kind_rows = torch.stack([heads.embed.weight[ids].mean(0) for ids in heads.name_ids["kind"]])  # (kinds, D)
    kind_cosines = unit(tokens[shape], dim=-1) @ unit(kind_rows, dim=-1).T
    expected = kind_cosines.gather(1, labels[shape, 0][:, None]).mean().item()
    assert accuracy["kind_share"] == pytest.approx(expected, abs=1e-6)
    assert "place_share" not in accuracy and "total_share" not in train_shapes.dense_scores(
        model.model.visual, linear, pixels, grid, labels)[1]
    # the three counts' losses together weigh one name's
    counts_only = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, width, structured=train_shapes.COUNT_HEADS,
                                         count_heads="cosine")
    _, _, count_labels = train_shapes.dense_batch(processor, seeds, structured=train_shapes.COUNT_HEADS)
    loss = train_shapes.dense_scores(model.model.visual, counts_only, pixels, grid, count_labels)[0]
    logits = counts_only(tokens)
    ce = torch.nn.functional.cross_entropy
    names = ce(logits["kind"], count_labels[:, 0]) + ce(logits["colour"], count_labels[:, 1]) + ce(logits["centre"], count_labels[:, 2])
    counts = sum(ce(logits[n], count_labels[:, 3 + i]) for i, n in enumerate(train_shapes.COUNT_HEADS))
    assert train_shapes.COUNT_LOSS_WEIGHT == pytest.approx(1 / 3)
    torch.testing.assert_close(loss, names + counts / 3, rtol=1e-5, atol=1e-5)
    counts_only.count_weight = 0.1  # --count-weight
    torch.testing.assert_close(train_shapes.dense_scores(model.model.visual, counts_only, pixels, grid, count_labels)[0],
                               names + counts * 0.1, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="count_heads is 'cos': 'linear' or 'cosine'"):
        train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, width, structured=structured, count_heads="cos")


def test_a_cached_stage_1_records_its_options_and_older_caches_read_as_the_defaults():
    train_shapes = load_example("train_shapes")
    args = train_shapes.argparse.Namespace(vision_steps=4000, motion_steps=1250, recolour_share=0.5, recolour_kinds="",
                                           seed=0, count_heads="cosine", count_weight=0.1, stage1_init="place.pt")
    wanted = train_shapes.stage1_options(args, ("place", "total"), 512)
    cache = {"model": {"model.language_model.embed_tokens.weight": torch.zeros(512, 4)}, **wanted}
    assert train_shapes.cached_stage1_options(cache) == wanted
    # a cache from before seed, --count-heads, --count-weight and --stage1-init were saved (session 39's): their defaults
    old = {"model": cache["model"], "vision_steps": 4000, "structured": ("place",), "motion_steps": 1250, "recolour_share": 0.5}
    held = train_shapes.cached_stage1_options(old)
    assert (held["seed"], held["count_heads"], held["count_weight"], held["init"]) == (0, "linear", pytest.approx(1 / 3), None)
    assert held["recolour_kinds"] == ""  # and from before --recolour-kinds: none
    assert train_shapes.option_differences(held, {**held, "recolour_kinds": "circle=0.9"}) == (
        "recolour_kinds  (this run: circle=0.9)")
    assert train_shapes.option_differences(held, wanted) == (
        "structured place (this run: place,total), count_heads linear (this run: cosine), "
        "count_weight 0.3333333333333333 (this run: 0.1), init None (this run: place.pt)")
    assert train_shapes.option_differences(held, {**held, "structured": ()}) == "structured place (this run: none)"


def test_motion_stage_1_adds_clips_whose_tokens_learn_the_direction(tiny_tokenizer):
    from vlmkit.data import TASKS, make_sample
    from vlmkit.data.shapes import DIRECTIONS, video_cell_labels

    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    seeds = [5, 6, 7]  # seed 6 is TASKS[6], motion: a clip
    assert TASKS[6] == "motion"
    linear_heads = train_shapes.structured_heads("count,layout")  # the word heads relabel kind and colour
    pixels, grid, labels = train_shapes.dense_batch(processor, seeds, structured=linear_heads, motion=True)
    samples = [make_sample(seed, task=TASKS[seed % 7], difficulty=seed // 7 % 3) for seed in seeds]
    clip = samples[1]
    frames = clip["scene"]["motion"]["num_frames"]
    # the images' grids first, then the clip's: (ceil(frames / 2), rows, cols) in patches
    assert grid[-1].tolist() == [-(-frames // 2), clip["scene"]["height"] // 16, clip["scene"]["width"] // 16]
    assert grid[:, 0].tolist()[:2] == [1, 1] and int(grid.prod(-1).sum()) == len(pixels)
    # columns: kind, colour, centre, motion, the 6 structured heads, 12 box digits, where's x and y
    assert train_shapes.label_names(("total",), True) == ["kind", "colour", "centre", "motion", "total"]
    assert labels.shape[1] == 4 + 6 + 12 + 2
    image_tokens = sum(s["scene"]["height"] // 32 * s["scene"]["width"] // 32 for s in (samples[0], samples[2]))
    assert (labels[:image_tokens, 3] == len(DIRECTIONS)).all()  # images: still everywhere
    cells = video_cell_labels(clip["scene"])
    assert labels[image_tokens:, 3].tolist() == cells["motion"].flatten().tolist()
    assert labels[image_tokens:, 0].tolist() == cells["kind"].flatten().tolist()
    assert (labels[image_tokens:, 4:] == -100).all()  # no structured labels on clips
    assert (cells["motion"] == DIRECTIONS.index(clip["answer"])).sum() > 0
    # a batch of clips alone (a validation subset) needs no image
    only_clip = train_shapes.dense_batch(processor, [6], motion=True)
    assert torch.equal(only_clip[1], grid[-1:]) and torch.equal(only_clip[2], labels[image_tokens:, :4])
    heads = train_shapes.NameHeads(model.get_input_embeddings(), tiny_tokenizer, model.config.vision_config.out_hidden_size,
                                   structured=linear_heads, motion=True)
    loss, accuracy = train_shapes.dense_scores(model.model.visual, heads, pixels, grid, labels)
    loss.backward()
    assert torch.isfinite(loss) and heads.background["motion"].grad is not None
    assert {"motion", "still", "box_hundreds", "where"} <= set(accuracy)
    assert all(-1 <= v <= 1 if name.endswith("_share") else 0 <= v <= 1 for name, v in accuracy.items())  # shares are cosines


def test_stage_1_shows_clips_only_in_its_last_motion_steps(tiny_tokenizer, monkeypatch):
    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    real_batch, calls = train_shapes.dense_batch, []

    def recording_batch(processor, seeds, split="train", structured=(), motion=False, recolour=0.0, recolour_kinds=None):
        calls.append((split, len(seeds), motion, recolour, recolour_kinds))
        return real_batch(processor, seeds, split=split, structured=structured, motion=motion, recolour=recolour,
                          recolour_kinds=recolour_kinds)

    monkeypatch.setattr(train_shapes, "dense_batch", recording_batch)
    curve, heads = train_shapes.pretrain_vision(model, processor, steps=3, batch_size=7, lr=1e-3, seed=0, eval_every=3,
                                                motion_steps=1, recolour=0.25, recolour_kinds={"star": 1.0})
    # the validation set (96 validation scenes, clips among them) is built once, then 2 steps of stills, 1 with clips
    stars = {"star": 1.0}
    assert calls == [("validation", 96, True, 0.0, None), ("train", 7, False, 0.25, stars), ("train", 7, False, 0.25, stars),
                     ("train", 7, True, 0.25, stars)]
    assert heads.motion and [row["step"] for row in curve] == [3]
    assert {"motion", "still", "kind_heldout_pairs", "colour_heldout_pairs"} <= set(curve[0]) and 0 <= curve[0]["motion"] <= 1


def test_stage_1_goes_on_from_a_cache_with_its_heads_and_the_images_after_its_own(tiny_tokenizer, monkeypatch):
    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    cached_curve, heads = train_shapes.pretrain_vision(model, processor, steps=2, batch_size=2, lr=1e-3, seed=0, eval_every=0,
                                                       structured=("place",))
    cache = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "heads": {k: v.clone() for k, v in heads.state_dict().items()}, "vision_curve": cached_curve}
    real_batch, seeds_seen = train_shapes.dense_batch, []

    def recording_batch(processor, seeds, split="train", **options):
        seeds_seen.append(list(seeds))
        return real_batch(processor, seeds, split=split, **options)

    monkeypatch.setattr(train_shapes, "dense_batch", recording_batch)
    fresh_model, _ = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    loaded = {}
    real_load = train_shapes.continued_heads

    def recording_load(new_heads, saved):  # the heads as the cache left them, before the first step moves them
        real_load(new_heads, saved)
        loaded.update({k: v.clone() for k, v in new_heads.state_dict().items()})

    monkeypatch.setattr(train_shapes, "continued_heads", recording_load)
    curve, more = train_shapes.pretrain_vision(fresh_model, processor, steps=2, batch_size=2, lr=1e-3, seed=0, eval_every=1,
                                               structured=("place", "total"), count_heads="cosine", init=cache)
    # the validation set, then steps 3 and 4 of seed 0's stream: seeds 7,000,000 + step x 2 + i
    assert seeds_seen[1:] == [[7_000_006, 7_000_007], [7_000_008, 7_000_009]]
    assert [row["step"] for row in curve] == [3, 4]
    assert all(torch.equal(loaded[k], v) for k, v in cache["heads"].items())  # place, names, temperature as cached
    assert "structured.total.directions" in loaded and "structured.total.directions" not in cache["heads"]
    assert set(more.structured) == {"place", "total"}


def test_stage_1_refuses_a_cache_whose_heads_it_would_drop_or_reshape(tiny_tokenizer):
    train_shapes = load_example("train_shapes")
    model, _ = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    embed, width = model.get_input_embeddings(), model.config.vision_config.out_hidden_size
    counted = train_shapes.NameHeads(embed, tiny_tokenizer, width, structured=("place", "total"), count_heads="cosine")
    placed = train_shapes.NameHeads(embed, tiny_tokenizer, width, structured=("place",))
    with pytest.raises(ValueError, match=r"^the stage-1 cache has heads this run lacks: structured\.total\.bias, "
                                         r"structured\.total\.directions$"):
        train_shapes.continued_heads(placed, counted.state_dict())
    linear = train_shapes.NameHeads(embed, tiny_tokenizer, width, structured=("place", "total"))
    with pytest.raises(ValueError, match=r"lacks: structured\.total\.directions$"):  # a linear head has weight and bias
        train_shapes.continued_heads(linear, counted.state_dict())
    wider = train_shapes.NameHeads(embed, tiny_tokenizer, width + 4, structured=("place",))
    with pytest.raises(ValueError, match=rf"differ in shape: .*structured\.place\.directions \(2, {width}\) "
                                         rf"\(this run: \(2, {width + 4}\)\)"):
        train_shapes.continued_heads(wider, placed.state_dict())


@pytest.mark.parametrize("eval_every, probed_at", [(0, [3]), (2, [2, 3]), (1, [1, 2, 3])])
def test_stage_1_probes_every_eval_every_steps_and_at_its_end(tiny_tokenizer, monkeypatch, eval_every, probed_at):
    # --eval-every 0 once probed stage 1 after every step (max(1, 0)), not "none"
    train_shapes = load_example("train_shapes")
    model, processor = train_shapes.build_model_and_processor(tiny_tokenizer, smoke=True)
    monkeypatch.setattr(train_shapes, "vision_validation", lambda *args: None)
    monkeypatch.setattr(train_shapes, "vision_probe", lambda visual, heads, validation: {"kind": 0.5})
    curve, _ = train_shapes.pretrain_vision(model, processor, steps=3, batch_size=2, lr=1e-3, seed=0, eval_every=eval_every)
    assert [row["step"] for row in curve] == probed_at and all(row["kind"] == 0.5 for row in curve)


@pytest.mark.parametrize("flags, message", [
    (["--centre-steps", "10", "--centre-mixed-steps", "20"], "--centre-mixed-steps is 20, not between 0 and --centre-steps (10)"),
    (["--centre-steps", "10", "--centre-mixed", "--centre-mixed-steps", "5"], "give it or --centre-mixed-steps, not both"),
    (["--init-from", "some/run", "--polish-steps", "0"], "--init-from skips stages 1 and 2: give --polish-steps too"),
    (["--polish-steps", "5", "--polish-tasks", "colour,spelling"], "--polish-tasks spelling are neither ShapesWorld tasks"),
    (["--recolour-share", "1.5"], "--recolour-share is 1.5, not a share between 0 and 1"),
    (["--polish-colour-swap", "-0.1"], "--polish-colour-swap is -0.1, not a share between 0 and 1"),
    (["--polish-colour-swap", "0", "--polish-colour-swap-max-shapes", "1"],
     "--polish-colour-swap-max-shapes is 1: it needs a --polish-colour-swap share"),
    (["--count-heads", "cosine"], ("--count-heads cosine reads the counts (total, colour_count, kind_count), and "
                                   "--structured-heads place has none: add count")),
    (["--count-weight", "0.1"], "--count-weight 0.1 weighs the cosine count heads: add --count-heads cosine"),
    (["--stage1-init", "no/such.pt"], "--stage1-init no/such.pt: no such file"),
    (["--stage1-init", "some.pt", "--vision-steps", "0"], "--stage1-init some.pt goes on with stage 1: give --vision-steps"),
    (["--micro-batches", "3"], "--micro-batches 3 does not split --batch-size 32 into equal micro-batches"),
    (["--recolour-kinds", "circle=2"], "--recolour-kinds: 'circle=2' is not KIND=SHARE"),
    (["--stage2-cache", "s2.pt", "--init-from", "run", "--polish-steps", "1"],
     "--init-from skips stages 1 and 2, so --stage2-cache s2.pt has nothing to save or load")])
def test_train_shapes_rejects_phases_it_cannot_run(tmp_path, flags, message):
    result = run_train_shapes("--out", tmp_path, *flags)
    assert result.returncode == 2 and message in result.stderr


def test_train_shapes_defaults_are_the_shipped_models_recipe():
    # README: the shipped model came from `train_shapes.py --out vlmkit/default_model`, the defaults;
    # its training log records every option, so a changed default shows here
    train_shapes = load_example("train_shapes")
    defaults = vars(train_shapes.build_parser().parse_args(["--out", "run"]))
    with open(os.path.join(ROOT, "vlmkit", "default_model", "training_log.json")) as handle:
        log = json.load(handle)
    # resolved in main(): the cosine count weight, and the opening bar (0 with --smoke)
    assert defaults["count_weight"] is None and defaults["opening_bar"] is None
    defaults.update(count_weight=train_shapes.COUNT_LOSS_WEIGHT, opening_bar=0.7,
                    structured_heads=defaults["structured_heads"].split(","))
    recorded = sorted(set(defaults) & set(log))
    assert len(recorded) == 42
    assert {name: log[name] for name in recorded} == {name: defaults[name] for name in recorded}


def test_probe_tower_shapes_reads_each_shape_from_all_its_tokens():
    probe = load_example("probe_tower_shapes")
    shapes = probe.train_shapes
    model, processor = shapes.build_model_and_processor(shapes.shapes_tokenizer(smoke=True), smoke=True)
    samples = shapes.dense_samples(list(range(12)), split="validation")
    _, _, labels = shapes.dense_labels(processor, samples)  # (N, kind / colour / centre): the tokens' true names
    cell = processor.image_processor.patch_size * processor.image_processor.merge_size
    owners = [torch.from_numpy(probe.cell_owners(s["scene"], cell=cell).reshape(-1)) for s in samples]
    kinds = labels[:, 0].clone()
    offset = 0
    for owner in owners:  # every shape's first token names the next kind instead
        for index in owner[owner >= 0].unique():
            first = offset + int((owner == index).nonzero()[0])
            kinds[first] = (kinds[first] + 1) % len(KINDS)
        offset += len(owner)

    def oracle(tokens):
        assert len(tokens) == len(labels)
        return {"kind": torch.nn.functional.one_hot(kinds, len(KINDS) + 1).float(),
                "colour": torch.nn.functional.one_hot(labels[:, 1], len(COLOURS) + 1).float()}

    rows = probe.shape_reads(model, processor, oracle, samples, batch_size=len(samples))
    tokens = [int((owner == i).sum()) for s, owner in zip(samples, owners) for i in range(len(s["scene"]["shapes"]))]
    assert [r["tokens"] for r in rows] == tokens and 1 in tokens and 2 in tokens and max(tokens) >= 3
    claimed = [(r, n) for r, n in zip(rows, tokens) if n]
    # one wrong token of n: (n - 1) / n of them right; pooled, n - 1 votes beat 1 from three tokens on
    assert [r["kind_tokens"] for r, _ in claimed] == pytest.approx([(n - 1) / n for _, n in claimed])
    assert [r["kind_pooled"] for r, n in claimed if n != 2] == [int(n >= 3) for _, n in claimed if n != 2]
    assert all(r["colour_tokens"] == 1.0 and r["colour_pooled"] == 1 for r, _ in claimed)
    assert all("kind_tokens" not in r for r, n in zip(rows, tokens) if not n)
    summary = probe.breakdowns(rows)["all"]["all"]
    assert summary["shapes"] == len(rows) and summary["unclaimed"] == round(tokens.count(0) / len(rows), 4)
    assert summary["kind_pooled"] == round(sum(r["kind_pooled"] for r, _ in claimed) / len(claimed), 4)
    # a one-token shape is read as the next kind, the one its only token names
    one_token = [r for r, n in claimed if n == 1]
    assert one_token and all(r["kind_read_as"] == (KINDS.index(r["kind"]) + 1) % len(KINDS) for r in one_token)
    # shapes no token shows count as unclaimed, and not in the reads
    read = {"tokens": 2, "kind": "star", "kind_tokens": 0.5, "kind_pooled": 0, "kind_read_as": KINDS.index("circle"),
            "colour_tokens": 1.0, "colour_pooled": 1, "colour_read_as": 0}
    assert probe.summary([{"tokens": 0, "kind": "star"}, read, dict(read, kind_pooled=1, kind_read_as=KINDS.index("star"))]) == {
        "shapes": 3, "unclaimed": 0.3333, "kind_tokens": 0.5, "kind_pooled": 0.5, "colour_tokens": 1.0,
        "colour_pooled": 1.0, "kind_misread_as": {"circle": 1}}

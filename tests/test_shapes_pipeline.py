"""The ShapesWorld training script (20-step smoke version) and the `vlmkit` command on its output."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers import OFFLINE_ENV, run_train_shapes

from vlmkit.cli import COUNT_VARIANTS, EXISTENCE_CASES, existence_case, format_report
from vlmkit.data import CAPTION_FIELDS, HELDOUT_COMBOS, make_sample

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_existence_cases_say_what_the_scene_holds_of_the_named_shape():
    samples = [make_sample(seed, task="existence", split="test") for seed in range(200)]
    cases = [existence_case(s) for s in samples]
    for sample, case in zip(samples, cases):
        query, shapes = sample["query"], sample["scene"]["shapes"]
        named = [(s["colour"] == query["colour"], s["kind"] == query["kind"]) for s in shapes]
        assert (case == "present") == ((True, True) in named) == query["present"]
        if case == "colour_and_kind_apart":
            assert (True, False) in named and (False, True) in named
    # ShapesWorld's "no" names the colour of one shape and the kind of another; a lone shape gives one of them
    several = [c for c, s in zip(cases, samples) if len(s["scene"]["shapes"]) > 1 and c != "present"]
    alone = [c for c, s in zip(cases, samples) if len(s["scene"]["shapes"]) == 1 and c != "present"]
    assert set(several) == {"colour_and_kind_apart"} and set(alone) == {"colour_only", "kind_only"}
    assert len(several) >= 50 and len(alone) >= 5


@pytest.mark.slow
def test_eval_report_says_how_boxes_and_captions_miss():
    entry = {"n": 2, "accuracy": 0.0, "majority_rate": 0.5, "blank_accuracy": 0.0,
             "accuracy_by_shapes": {"1": 0.0}, "n_by_shapes": {"1": 2}}
    report = {"split": "test", "num_samples": 4, "seconds": 1.0, "tasks": {
        "grounding": {**entry, "mean_iou": 0.25, "blank_mean_iou": 0.0, "boxes_parsed": 1.0,
                      "median_centre_error": 143.4, "median_size_ratio": 1.15},
        "caption": {**entry, "caption_in_training_set": 0.5, "caption_novelty": 0.5,
                    "field_accuracy": dict(zip(CAPTION_FIELDS, (0.24, 0.65, 0.53, 0.36, 0.15))),
                    "kind_accuracy_by_pair": {"seen": 0.8367, "heldout": 0.3721}, "n_kind_by_pair": {"seen": 49, "heldout": 43},
                    "kind_accuracy_by_pair_and_shapes": {"seen 1": 0.9, "seen 3": 0.8205, "heldout 1": 0.4419},
                    "n_kind_by_pair_and_shapes": {"seen 1": 10, "seen 3": 39, "heldout 1": 43}},
        "count": {**entry, "accuracy_by_variant": {"all": 1.0, "kind": 0.4286}, "n_by_variant": {"all": 3, "kind": 7}},
        "existence": {**entry, "accuracy_by_case": {"present": 0.8182, "colour_and_kind_apart": 0.9348},
                      "n_by_case": {"present": 44, "colour_and_kind_apart": 46}}}}
    text = format_report(report)
    assert "Existence by what the scene holds of the named shape (questions): present 82% (44), colour and kind apart 93% (46)" in text
    assert "Count by what the question names (questions): all shapes 100% (3), one kind 43% (7)" in text
    assert "mean IoU 0.250 (blank 0.000); box centres off by 143 / 1000, sides x1.15 (medians)" in text
    assert ("50% of captions occur in training; fields right: background 24%, shape count 65%, size 53%, "
            "colour 36%, kind 15%; kinds right in colour-kind pairs seen 84% (49 shapes), held out 37% (43 shapes); "
            "by pair and shapes in the scene seen 1 90% (10), seen 3 82% (39), held out 1 44% (43)") in text


def test_train_shapes_smoke_then_eval_and_demo(tmp_path):
    out = tmp_path / "shapes"
    train = run_train_shapes("--smoke", "--out", out,
                             "--existence-group", "4", "--followups", "2", "--loss", "answer", "--word-tokenizer",
                             "--opening-steps", "2", "--lr-schedule", "constant_with_warmup", "--text-every", "4",
                             "--vision-lr-scale", "0.3", "--deepstack-lr-scale", "0.3",
                             "--frame-difference-lr-scale", "1", "--polish-steps", "3", "--polish-tasks", "existence,centre")
    assert train.returncode == 0, train.stderr[-3000:]
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 20 and len(log["curve"]) >= 5 and all(p["loss"] > 0 for p in log["curve"])
    # the machine its minutes were measured on (runs are compared across CPUs)
    assert log["machine"]["threads"] >= 1 and log["machine"]["torch"] == torch.__version__
    assert isinstance(log["machine"]["cpu"], str) and isinstance(log["machine"]["avx512"], bool)
    # 4 text-only steps open stage 2 (described scenes), 2 of the opening tasks, then 20 of the curriculum;
    # validation probes every 10 steps and at the end: exact match per task, with the image and with a blank one
    assert log["text_steps"] == 4 and log["text_every"] == 4
    assert log["opening_steps"] == 2 and log["opening_tasks"] == "colour,existence,count"
    assert log["lr_schedule"] == "constant_with_warmup"
    assert log["frame_difference_lr_scale"] == 1.0
    # the defaults: 2 steps of centre questions alone (750 in a full run) after the opening, position as
    # minimal-pair groups, a stage-1 place head
    assert log["centre_steps"] == 2 and log["position_group"] == 8 and log["structured_heads"] == ["place"]
    assert log["tasks"] == "caption,count,colour,existence,position,grounding,motion,centre,position,background,kind"
    # 4 length-sorted micro-batches of one sample each, and no opening check (a 2-step opening cannot pass 0.7)
    assert log["micro_batches"] == 4 and log["opening_bar"] == 0.0 and log["opening_checks"] == []
    assert [e["step"] for e in log["evals"]] == [10, 20, 28]
    # then 3 polish steps (a fresh schedule and step count), probed at their end
    assert log["polish_steps"] == 3 and log["polish_tasks"] == "existence,centre"
    assert [e["step"] for e in log["polish_evals"]] == [3] and len(log["polish_curve"]) == 3
    tasks = ("caption", "count", "colour", "existence", "position", "grounding", "motion")
    assert all(0.0 <= e[f"{t}/{kind}"] <= 1.0 for e in log["evals"] for t in tasks for kind in ("image", "blank"))
    # stage 1 (dense per-token supervision of the vision tower): 10 steps, one validation probe
    assert log["vision_steps"] == 10 and [row["step"] for row in log["vision_curve"]] == [10]
    probe = log["vision_curve"][0]
    assert probe["loss"] > 0 and all(0.0 <= probe[k] <= 1.0 for k in ("kind", "colour", "background", "centre", "motion", "still"))
    assert log["motion_steps"] == 5  # the default 2,250, cut to half of the smoke run's stage 1
    # and the same heads on the same images after stage 2: what the VLM's training left of stage 1
    after = log["vision_after_stage_2"]
    assert set(after) == {"kind", "colour", "background", "centre", "place", "motion", "still", "kind_heldout_pairs",
                          "colour_heldout_pairs", "kind_share", "colour_share"}
    assert all(-1.0 <= v <= 1.0 if k.endswith("_share") else 0.0 <= v <= 1.0 for k, v in after.items())  # shares are cosines
    assert log["recolour_share"] == 0.5 and {"kind_heldout_pairs", "colour_heldout_pairs"} <= set(probe)
    assert log["existence_group"] == 4
    # every image sample a conversation: its question, then 2 more about the same image, each answer weighing the
    # same; one token per word and per role name, digits split
    assert log["followups"] == 2 and log["loss"] == "answer" and log["batch_size"] == 4 and log["word_tokenizer"]
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert {"user", "assistant", "Ġpurple"} <= set(tokenizer["model"]["vocab"])
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert not (out / "trainer").exists()

    evaluation = subprocess.run([sys.executable, "-m", "vlmkit.cli", "--model", str(out), "eval", "--num", "14", "--json",
                                 "--novelty-reference", "300"],
                                capture_output=True, text=True, timeout=600, env=OFFLINE_ENV)
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    report = json.loads(evaluation.stdout)
    assert report["num_samples"] == 14
    assert set(report["tasks"]) == {"caption", "count", "colour", "existence", "position", "grounding", "motion"}
    assert sum(entry["n"] for entry in report["tasks"].values()) == 14
    for entry in report["tasks"].values():
        assert entry["n"] >= 1 and 0.0 <= entry["accuracy"] <= 1.0 and 0.0 < entry["majority_rate"] <= 1.0
        # the per-shape-count breakdown partitions the task's questions
        assert sum(entry["n_by_shapes"].values()) == entry["n"]
        weighted = sum(entry["accuracy_by_shapes"][n] * entry["n_by_shapes"][n] for n in entry["n_by_shapes"])
        assert abs(weighted / entry["n"] - entry["accuracy"]) <= 1e-3
        # and each question's grade, in the order asked, for ship_check's paired comparison
        assert len(entry["hits"]) == entry["n"] and set(entry["hits"]) <= {"0", "1"}
        assert abs(entry["hits"].count("1") / entry["n"] - entry["accuracy"]) <= 1e-4
    assert report["seed"] == 0 and len(report["questions_sha1"]) == 40
    grounding = report["tasks"]["grounding"]
    assert len(grounding["ious"]) == grounding["n"] and abs(sum(grounding["ious"]) / grounding["n"] - grounding["mean_iou"]) <= 1e-3
    assert 0.0 <= report["tasks"]["grounding"]["mean_iou"] <= 1.0
    assert 0.0 <= report["tasks"]["grounding"]["boxes_parsed"] <= 1.0
    caption = report["tasks"]["caption"]
    assert list(caption["field_accuracy"]) == list(CAPTION_FIELDS)
    # every true shape of the asked captions counted once, as a seen or a held-out colour-kind pair
    # (eval --num 14 asks captions 0 and 7 of the seen questions and caption 0 of the held-out ones)
    asked = [make_sample(i, task="caption", split="test") for i in (0, 7)] + [make_sample(0, task="caption", split="test", heldout=True)]
    shape_pairs = [("heldout" if (s["colour"], s["kind"]) in HELDOUT_COMBOS else "seen", len(a["scene"]["shapes"]))
                   for a in asked for s in a["scene"]["shapes"]]
    pairs = Counter(pair for pair, _ in shape_pairs)
    assert caption["n_kind_by_pair"] == dict(pairs) and pairs["heldout"] >= 1
    # the same shapes again, each under its pair and its scene's shape count
    by_scene = Counter(f"{pair} {n}" for pair, n in shape_pairs)
    assert caption["n_kind_by_pair_and_shapes"] == dict(by_scene)
    for pair, n in pairs.items():
        weighted = sum(caption["kind_accuracy_by_pair_and_shapes"][key] * by_scene[key] for key in by_scene if key.startswith(pair))
        assert abs(weighted / n - caption["kind_accuracy_by_pair"][pair]) <= 1e-3
    existence = report["tasks"]["existence"]
    assert sum(existence["n_by_case"].values()) == existence["n"] and set(existence["n_by_case"]) <= set(EXISTENCE_CASES)
    count = report["tasks"]["count"]
    assert sum(count["n_by_variant"].values()) == count["n"] and set(count["n_by_variant"]) <= set(COUNT_VARIANTS)

    demo = subprocess.run([sys.executable, "-m", "vlmkit.cli", "--model", str(out), "demo"],
                          capture_output=True, text=True, timeout=600, env=OFFLINE_ENV)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert demo.stdout.count("truth:") == 7 and "correct in" in demo.stdout

    # --init-from: more polish steps on the saved run, nothing else; its log keeps the first run's
    polished = tmp_path / "polished"
    again = run_train_shapes("--smoke", "--out", polished, "--init-from", out, "--polish-steps", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((polished / "training_log.json").read_text())
    assert second["init_from"] == str(out) and second["init_from_log"]["polish_steps"] == 3
    assert second["vision_steps"] == second["steps"] == 0 and second["evals"] == [] and len(second["polish_curve"]) == 2
    assert (polished / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()


def test_train_shapes_stops_with_the_scores_when_every_opening_misses_existence(tmp_path):
    # no 6-step tiny model answers all 8 existence questions: both openings miss the bar
    result = run_train_shapes("--smoke", "--out", tmp_path / "run", "--opening-bar", "1", "--opening-tries", "2", "--seed", "3")
    # no model: the folder holds the failed openings' record and nothing else
    assert result.returncode != 0 and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["failed_openings.json"]
    checks = [json.loads(line)["opening_check"] for line in result.stdout.splitlines() if line.startswith('{"opening_check"')]
    # what the tries measured is kept beside: each check with its validation curve, and stage 1's curve
    record = json.loads((tmp_path / "run" / "failed_openings.json").read_text())
    assert [(c["seed"], c["existence"]) for c in record["opening_checks"]] == [(3, checks[0]["existence"]), (4, checks[1]["existence"])]
    assert all("evals" in c for c in record["opening_checks"]) and [row["step"] for row in record["vision_curve"]] == [10]
    assert record["options"]["opening_bar"] == 1.0 and record["machine"]["threads"] >= 1
    assert [(c["step"], c["questions"], c["bar"]) for c in checks] == [(6, 8, 1.0)] * 2  # 4 text + 2 opening steps
    scores = [f"{c['existence']:.0%} (seed {seed})" for c, seed in zip(checks, (3, 4))]
    assert (f"stage 2's opening missed existence in all 2 tries: at step 6, {scores[0]}, {scores[1]} of 8 validation "
            "questions right, below --opening-bar 100%; try another --seed, or more --opening-tries") in result.stderr


def test_train_shapes_without_stage_2_steps_skips_stage_2(tmp_path):
    # no stage-2 steps: stage 2 is skipped (Trainer refuses max_steps 0 over a stream), so a cached stage 1 can be probed alone
    out = tmp_path / "run"
    result = run_train_shapes("--out", out, "--vision-steps", "0", "--steps", "0", "--opening-steps", "0",
                              "--centre-steps", "0", "--polish-steps", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 0 text + 0 centre + 0 opening + 0 + 0 polish steps" in result.stdout
    log = json.loads((out / "training_log.json").read_text())
    assert log["curve"] == [] and log["evals"] == [] and log["vision_after_stage_2"] is None


@pytest.mark.slow
def test_train_shapes_stage1_cache_is_saved_reused_and_checked(tmp_path):
    cache = tmp_path / "stage1.pt"

    def train(*extra, cache=cache):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        return run_train_shapes("--smoke", "--out", out, "--stage1-cache", cache, *extra), out

    first, out = train()
    assert first.returncode == 0, first.stderr[-3000:]
    assert cache.exists()
    second, again = train()
    assert second.returncode == 0, second.stderr[-3000:]
    ran, loaded = (json.loads((path / "training_log.json").read_text()) for path in (out, again))
    assert not ran["stage1_from_cache"] and loaded["stage1_from_cache"]
    assert loaded["vision_curve"] == ran["vision_curve"] and loaded["stage1_minutes"] == ran["stage1_minutes"]
    assert loaded["minutes"] >= loaded["stage1_minutes"]  # the cached stage 1 still counts in the run's time
    # --stage1-init: 10 more smoke steps with count heads after the cached 10; the curve and the minutes go on
    more = tmp_path / "more.pt"
    went_on, longer = train("--stage1-init", str(cache), "--structured-heads", "place,count", cache=more)
    assert went_on.returncode == 0, went_on.stderr[-3000:]
    longer_log = json.loads((longer / "training_log.json").read_text())
    assert longer_log["vision_curve"][:len(ran["vision_curve"])] == ran["vision_curve"]
    assert [row["step"] for row in longer_log["vision_curve"][len(ran["vision_curve"]):]] == [20]
    assert "total" in longer_log["vision_curve"][-1] and "total" not in ran["vision_curve"][-1]
    assert torch.load(more)["minutes"] > torch.load(cache)["minutes"] and torch.load(more)["init"] == str(cache)
    # and on again from that one: the steps count from its last (20), not from its own 10
    again_on, further = train("--stage1-init", str(more), "--structured-heads", "place,count", cache=tmp_path / "again.pt")
    assert again_on.returncode == 0, again_on.stderr[-3000:]
    assert [row["step"] for row in json.loads((further / "training_log.json").read_text())["vision_curve"]] == [10, 20, 30]
    mismatch, _ = train("--word-tokenizer")  # another tokenizer: another vocabulary than the cached embeddings
    assert mismatch.returncode != 0
    assert mismatch.stderr.rstrip().endswith("holds another stage 1 than this run's: vocab 512 (this run: 640)")
    structured, _ = train("--structured-heads", "where,count")  # the cached tower was taught the place head, not these
    assert structured.returncode != 0
    assert structured.stderr.rstrip().endswith(": structured place (this run: total,colour_count,kind_count,where)")
    stills, _ = train("--motion-steps", "0")  # the cached tower was shown clips
    assert stills.returncode != 0
    assert stills.stderr.rstrip().endswith(": motion_steps 5 (this run: 0)")
    seeded, _ = train("--seed", "1")  # the cached tower is seed 0's
    assert seeded.returncode != 0
    assert seeded.stderr.rstrip().endswith(": seed 0 (this run: 1)")
    palette, _ = train("--recolour-share", "0")  # the cached tower also saw off-palette shapes
    assert palette.returncode != 0
    assert palette.stderr.rstrip().endswith(": recolour_share 0.5 (this run: 0.0)")
    # a tower whose counts a linear head read is not one whose counts lean its tokens' direction
    counted = tmp_path / "counted.pt"
    linear, _ = train("--structured-heads", "place,count", cache=counted)
    assert linear.returncode == 0, linear.stderr[-3000:]
    cosine, _ = train("--structured-heads", "place,count", "--count-heads", "cosine", cache=counted)
    assert cosine.returncode != 0
    assert cosine.stderr.rstrip().endswith(": count_heads linear (this run: cosine)")


@pytest.mark.slow
def test_train_shapes_stage2_cache_gives_the_polish_a_single_run_would_train(tmp_path):
    cache = tmp_path / "stage2.pt"

    def train(name, *extra):
        out = tmp_path / name
        return run_train_shapes("--smoke", "--out", out, "--stage2-cache", cache, *extra), out

    first, ran = train("ran")
    assert first.returncode == 0, first.stderr[-3000:]
    assert cache.exists() and "stage 1 (vision): 10 steps" in first.stdout
    second, loaded = train("loaded")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "stages 1 and 2: loaded from" in second.stdout and "stage 1 (vision)" not in second.stdout
    ran_log, loaded_log = (json.loads((path / "training_log.json").read_text()) for path in (ran, loaded))
    assert not ran_log["stage2_from_cache"] and loaded_log["stage2_from_cache"]
    for name in ("vision_curve", "stage1_minutes", "curve", "evals", "stage_2_seed", "opening_checks", "vision_after_stage_2"):
        assert loaded_log[name] == ran_log[name], name
    # the polish over the cached model is the single run's, to the bit
    assert len(ran_log["polish_curve"]) == 3
    assert [(row["step"], row["loss"]) for row in loaded_log["polish_curve"]] == \
        [(row["step"], row["loss"]) for row in ran_log["polish_curve"]]
    assert (loaded / "model.safetensors").read_bytes() == (ran / "model.safetensors").read_bytes()
    # stages 1 and 2 still count in the run's time (which the log rounds to a tenth of a minute)
    cached_minutes = torch.load(cache)["minutes"]
    assert cached_minutes > 0 and loaded_log["minutes"] >= round(cached_minutes, 1)
    # another polish over the same stages 1 and 2 matches the cache; any other option does not
    other, polished = train("other", "--polish-steps", "2", "--polish-lr", "1e-4")
    assert other.returncode == 0, other.stderr[-3000:]
    assert json.loads((polished / "training_log.json").read_text())["polish_steps"] == 2
    # another polish seed: the same stages 1 and 2, other scenes in the polish
    reseeded, repolished = train("reseeded", "--polish-seed", "7")
    assert reseeded.returncode == 0, reseeded.stderr[-3000:]
    reseeded_log = json.loads((repolished / "training_log.json").read_text())
    assert reseeded_log["stage2_from_cache"] and reseeded_log["polish_seed"] == 7 and ran_log["polish_seed"] is None
    assert reseeded_log["polish_curve"][0]["loss"] != ran_log["polish_curve"][0]["loss"]
    seeded, _ = train("seeded", "--seed", "1")
    assert seeded.returncode != 0
    assert seeded.stderr.rstrip().endswith("holds other stages 1 and 2 than this run's: seed 0 (this run: 1)")

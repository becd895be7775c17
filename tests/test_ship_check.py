import copy
import json
import os

import pytest
from helpers import ROOT, load_script

SHIPPED_EVAL = os.path.join(ROOT, "benchmarks", "results", "default_model_eval_test_6300.json")


@pytest.fixture(scope="module")
def ship_check():
    return load_script("benchmarks", "ship_check")


@pytest.fixture()
def shipped():
    with open(SHIPPED_EVAL) as f:
        return json.load(f)


def failed(checks):
    return [name for name, passed, _ in checks if not passed]


def regrade(task, wrong_to_right=0, right_to_wrong=0):
    """Make the first `wrong_to_right` wrong answers of `task` right and its first `right_to_wrong` right
    ones wrong, as another model's eval of the same questions would, and its accuracy with them."""
    hits = list(task["hits"])
    wrong = [i for i, hit in enumerate(hits) if hit == "0"][:wrong_to_right]
    right = [i for i, hit in enumerate(hits) if hit == "1"][:right_to_wrong]
    assert len(wrong) == wrong_to_right and len(right) == right_to_wrong
    for i in wrong:
        hits[i] = "1"
    for i in right:
        hits[i] = "0"
    task["hits"] = "".join(hits)
    task["accuracy"] = round(task["hits"].count("1") / len(hits), 4)


def test_the_shipped_eval_grades_each_question(shipped):
    for name, task in shipped["tasks"].items():
        assert len(task["hits"]) == task["n"] == 900, name
        assert task["hits"].count("1") / task["n"] == pytest.approx(task["accuracy"], abs=5e-5), name
    ious = shipped["tasks"]["grounding"]["ious"]
    assert len(ious) == 900 and sum(ious) / 900 == pytest.approx(shipped["tasks"]["grounding"]["mean_iou"], abs=5e-5)


def test_paired_difference_is_the_mean_difference_and_its_standard_error(ship_check):
    # 10 questions gained, 25 lost, 865 alike: d = -15/900; the differences' variance (35 - 900 d^2) / 899
    d, se = ship_check.paired_difference([1] * 10 + [0] * 25 + [1] * 865, [0] * 10 + [1] * 25 + [1] * 865)
    assert d == pytest.approx(-15 / 900)
    assert se == pytest.approx(((35 - 900 * (15 / 900) ** 2) / 899 / 900) ** 0.5)
    assert se == pytest.approx(0.006553, abs=1e-6)
    # the same accuracies on independent questions: each mean's variance p (1 - p) / 899, summed
    new, old = [1] * 450 + [0] * 450, [0] * 450 + [1] * 450
    assert ship_check.unpaired_standard_error(new, old) == pytest.approx((2 * 0.25 / 899) ** 0.5)
    assert ship_check.paired_difference(new, old) == (0.0, pytest.approx((900 / 899 / 900) ** 0.5))


def test_the_shipped_model_against_itself_loses_nothing_and_gains_nothing(ship_check, shipped):
    checks = ship_check.ship_checks(copy.deepcopy(shipped), shipped, minutes=80.0)
    # level on every question: not worth shipping, and (f) is the only check that says so
    assert failed(checks) == ["a clear gain"]
    # one check each: minutes, 3 accuracies kept, IoU, 2 with 2 points' slack, motion's floor, a gain;
    # then a held-out gap for every task with held-out questions and a blank lift for every task
    with_heldout = sum("accuracy_heldout" in task for task in shipped["tasks"].values())
    assert len(checks) == 9 + with_heldout + len(shipped["tasks"])


def test_each_rule_fails_on_its_own(ship_check, shipped):
    run = copy.deepcopy(shipped)
    tasks = run["tasks"]
    regrade(tasks["caption"], wrong_to_right=40, right_to_wrong=5)  # (f): d = 35/900, se 0.0073: +5.3 se
    regrade(tasks["count"], wrong_to_right=10, right_to_wrong=25)  # (b): d = -0.0167 < -se = -0.0066
    regrade(tasks["colour"], right_to_wrong=18)  # (c): 2 points allowed ...
    regrade(tasks["existence"], right_to_wrong=27)  # ... 3 are not
    tasks["motion"]["accuracy"] = 0.89
    ious = tasks["grounding"]["ious"]
    tasks["grounding"]["ious"] = [0.0 if i < 20 else value for i, value in enumerate(ious)]  # (b): 20 boxes worse
    # (d): shipped colour gap 0.9667 - 0.8800, so the limit is that + 0.02 = 0.1067
    tasks["colour"]["accuracy_seen"], tasks["colour"]["accuracy_heldout"] = 1.0, 0.85
    tasks["position"]["accuracy_heldout"] = tasks["position"]["accuracy_seen"] - 0.10  # limit max(0.10, gap + 0.02)
    tasks["existence"]["blank_accuracy"] += 0.06  # (e): limit max(0.05, shipped 0.0 + 0.02)
    tasks["count"]["blank_accuracy"] += 0.06  # shipped under the majority rate, now under 0.05 over: allowed
    assert failed(ship_check.ship_checks(run, shipped, minutes=121.0)) == [
        "minutes", "count", "grounding IoU", "existence", "motion", "colour held-out gap", "existence blank - majority",
    ]


def test_a_drop_within_one_standard_error_ships_with_a_clear_gain(ship_check, shipped, tmp_path, capsys):
    run = copy.deepcopy(shipped)
    regrade(run["tasks"]["count"], wrong_to_right=20, right_to_wrong=25)  # d = -0.0056, se 0.0075
    regrade(run["tasks"]["position"], wrong_to_right=30)  # d = +0.0333, se 0.0060: +5.6 se
    (tmp_path / "eval.json").write_text(json.dumps(run))
    (tmp_path / "log.json").write_text(json.dumps({"minutes": 95.5}))
    assert ship_check.main([str(tmp_path / "eval.json"), str(tmp_path / "log.json"), "--shipped", SHIPPED_EVAL]) == 0
    out = capsys.readouterr().out
    right, _, _, wrong = ship_check.agreement(shipped["tasks"]["count"]["hits"], shipped["tasks"]["count"]["hits"])
    assert f"right in both {right - 25}, run only 20, shipped only 25, wrong in both {wrong - 20}" in out
    assert "ok   count: " in out and "paired -0.0056, se 0.0075 (at least -0.0075; unpaired se " in out
    assert "ok   a clear gain: largest: position at +5.6 se (more than 2 needed)" in out
    assert out.rstrip().endswith("ships")


def test_a_run_missing_a_task_is_refused(ship_check, shipped):
    run = copy.deepcopy(shipped)
    del run["tasks"]["grounding"]
    with pytest.raises(ValueError, match=r"lacks tasks \['grounding'\]"):
        ship_check.ship_checks(run, shipped, minutes=60.0)


def test_evaluations_of_other_questions_are_refused(ship_check, shipped):
    run = copy.deepcopy(shipped)
    run["num_samples"] = 700
    with pytest.raises(ValueError, match="run was evaluated on 700 test questions and the shipped model on 6300 test"):
        ship_check.ship_checks(run, shipped, minutes=60.0)
    run = copy.deepcopy(shipped)
    run["questions_sha1"] = "0" * 40
    with pytest.raises(ValueError, match="asked different questions"):
        ship_check.ship_checks(run, shipped, minutes=60.0)
    del run["questions_sha1"]
    with pytest.raises(ValueError, match="run's eval has no per-question grades"):
        ship_check.ship_checks(run, shipped, minutes=60.0)


def test_main_prints_the_verdict_and_exits_1_when_the_run_does_not_ship(ship_check, shipped, tmp_path, capsys):
    run = copy.deepcopy(shipped)
    regrade(run["tasks"]["position"], right_to_wrong=45)  # 5 points: d = -0.05, se 0.0073
    (tmp_path / "eval.json").write_text(json.dumps(run))
    (tmp_path / "log.json").write_text(json.dumps({"minutes": 95.5}))
    assert ship_check.main([str(tmp_path / "eval.json"), str(tmp_path / "log.json"), "--shipped", SHIPPED_EVAL]) == 1
    out = capsys.readouterr().out
    new, old = run["tasks"]["position"]["accuracy"], shipped["tasks"]["position"]["accuracy"]
    assert f"FAIL position: {new:.3f} vs shipped {old:.3f}: paired -0.0500, se 0.0073 (at least -0.0073; unpaired se " in out
    assert "ok   minutes: 95.5 min (limit 120)" in out
    assert "FAIL a clear gain: largest: " in out
    assert out.rstrip().endswith("does not ship: 2 check(s) failed")

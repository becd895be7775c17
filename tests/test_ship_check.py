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


def test_the_shipped_model_passes_against_itself(ship_check, shipped):
    checks = ship_check.ship_checks(copy.deepcopy(shipped), shipped, minutes=80.0)
    assert failed(checks) == []
    # one check each: minutes, 3 accuracies kept, IoU, 2 with 2 points' slack, motion's floor;
    # then a held-out gap for every task with held-out questions and a blank lift for every task
    with_heldout = sum("accuracy_heldout" in task for task in shipped["tasks"].values())
    assert len(checks) == 8 + with_heldout + len(shipped["tasks"])


def test_each_rule_fails_on_its_own(ship_check, shipped):
    run = copy.deepcopy(shipped)
    tasks = run["tasks"]
    tasks["count"]["accuracy"] -= 0.01  # (b): any loss
    tasks["colour"]["accuracy"] -= 0.02  # (c): 2 points allowed ...
    tasks["existence"]["accuracy"] -= 0.03  # ... 3 are not
    tasks["motion"]["accuracy"] = 0.89
    tasks["grounding"]["mean_iou"] -= 0.001
    # (d): shipped colour gap 0.967 - 0.880 = 0.087, so the limit is that + 0.02 = 0.107
    tasks["colour"]["accuracy_seen"], tasks["colour"]["accuracy_heldout"] = 1.0, 0.85
    tasks["position"]["accuracy_heldout"] = tasks["position"]["accuracy_seen"] - 0.10  # limit max(0.10, 0.043 + 0.02)
    tasks["existence"]["blank_accuracy"] += 0.06  # (e): limit max(0.05, shipped 0.0 + 0.02)
    tasks["count"]["blank_accuracy"] += 0.06  # shipped 0.013 under the majority rate, now 0.047 over: allowed
    assert failed(ship_check.ship_checks(run, shipped, minutes=121.0)) == [
        "minutes", "count", "grounding IoU", "existence", "motion", "colour held-out gap", "existence blank - majority",
    ]


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


def test_main_prints_the_verdict_and_exits_1_when_the_run_does_not_ship(ship_check, shipped, tmp_path, capsys):
    run = copy.deepcopy(shipped)
    run["tasks"]["position"]["accuracy"] -= 0.05
    (tmp_path / "eval.json").write_text(json.dumps(run))
    (tmp_path / "log.json").write_text(json.dumps({"minutes": 95.5}))
    assert ship_check.main([str(tmp_path / "eval.json"), str(tmp_path / "log.json"), "--shipped", SHIPPED_EVAL]) == 1
    out = capsys.readouterr().out
    assert "FAIL position: 0.702 vs shipped 0.752" in out
    assert "ok   minutes: 95.5 min (limit 120)" in out
    assert out.rstrip().endswith("does not ship: 1 check(s) failed")

"""Does a trained ShapesWorld run replace the shipped model? The rule that sessions have applied by hand.

    python benchmarks/ship_check.py RUN_EVAL.json RUN/training_log.json
        [--shipped benchmarks/results/default_model_eval_test_6300.json]

RUN_EVAL.json is `vlmkit --model RUN eval --split test --num 6300 --json`: 900 questions a task, 300 of
them on held-out pairs, compared with the shipped model's on the same questions (5 minutes). The default
700 put one question at a point of a task and held-out gaps on 33 questions, too coarse to rank two
runs; on 2,100 (300 a task, a standard error of 2.5 points at 75%), sessions 51-52's polishes each
failed one check by one to three questions. 6,300 holds those 2,100 and has a standard error of 1.4.
Runs of one recipe still differ by a point or two there (session 53: the polish's seed alone moved
count 1.7 points), about the standard error of a difference of two accuracies on 900 questions, so a
rule of `new >= old` let the questions' noise decide. The accuracy checks therefore compare the two
evaluations question by question (`hits`, and grounding's `ious`, which `vlmkit eval --json` records):
the paired difference d (run - shipped, averaged over the task's questions) and its standard error se,
smaller than the unpaired one (printed beside it) because most questions two models answer alike.
The run ships only if every check holds:
  (a) training took at most 120 minutes (the issue's budget on this CPU);
  (b) position, count, caption and grounding IoU each lose at most one standard error: d >= -se;
  (c) colour and existence lose at most 2 points, and video direction stays at or above 90%;
  (d) no held-out gap (seen - held-out accuracy, colour-kind pairs never seen in training) is over
      max(10 points, the shipped model's gap + 2), the issue's 10 points unless shipped was already over;
  (e) with a blank image, no task is over its majority rate by more than max(5 points, the shipped
      model's excess + 2), the issue's 5 points likewise (an excess there is the language prior);
  (f) some task of (b) and (c) gains by more than two standard errors, d > 2 se: a run that is only
      level with the shipped model within noise is not worth a change of the shipped model.
The thresholds (one and two standard errors) were fixed in session 54, before any run they judge.
Prints one line per task and per check, and exits 1 if the run does not ship.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

DEFAULT_SHIPPED = Path(__file__).parent / "results" / "default_model_eval_test_6300.json"
MAX_MINUTES = 120
MUST_NOT_DROP = ("position", "count", "caption")  # (b), with grounding IoU
MAY_DROP_2_POINTS = ("colour", "existence")
MIN_MOTION = 0.90


MAX_DROP_SE = 1.0  # (b): a drop within this many standard errors of the paired difference is noise
MIN_GAIN_SE = 2.0  # (f)
GAIN_TASKS = MUST_NOT_DROP + ("grounding IoU",) + MAY_DROP_2_POINTS


def per_question(tasks, name):
    """A task's score on each question, in the order asked: 1 or 0, or the box's IoU for grounding IoU."""
    if name == "grounding IoU":
        return tasks["grounding"]["ious"]
    return [int(hit) for hit in tasks[name]["hits"]]


def headline(tasks, name):
    """A task's score as eval reports it: its accuracy, or grounding's mean IoU for grounding IoU."""
    return tasks["grounding"]["mean_iou"] if name == "grounding IoU" else tasks[name]["accuracy"]


def mean_and_standard_error(values):
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def paired_difference(new, old):
    """Mean of new - old over the same questions, and its standard error."""
    return mean_and_standard_error([a - b for a, b in zip(new, old, strict=True)])


def unpaired_standard_error(new, old):
    """The standard error of mean(new) - mean(old) were the two evals of independent questions: what
    comparing two accuracies alone is subject to, printed beside the paired one."""
    return (mean_and_standard_error(new)[1] ** 2 + mean_and_standard_error(old)[1] ** 2) ** 0.5


def agreement(new_hits, old_hits):
    """How two evals' grades of the same questions pair up: (right in both, right in the run only, right in
    the shipped model only, wrong in both). Errors in both are what neither model can do; the two
    middle counts are all a paired comparison rests on."""
    pairs = Counter(zip(new_hits, old_hits, strict=True))
    return pairs["1", "1"], pairs["1", "0"], pairs["0", "1"], pairs["0", "0"]


def held_out_gap(task):
    return task["accuracy_seen"] - task["accuracy_heldout"]


def blank_lift(task):
    return task["blank_accuracy"] - task["majority_rate"]


def ship_checks(run, shipped, minutes):
    """(name, passed, detail) for each rule; `run` and `shipped` are `vlmkit eval --json` results."""
    asked = [(e["split"], e["num_samples"]) for e in (run, shipped)]
    if asked[0] != asked[1]:
        raise ValueError(f"the run was evaluated on {asked[0][1]} {asked[0][0]} questions and the shipped model on "
                         f"{asked[1][1]} {asked[1][0]}: compare the same questions (eval --split test --num 6300)")
    for name, report in (("run's", run), ("shipped model's", shipped)):
        if "questions_sha1" not in report:
            raise ValueError(f"the {name} eval has no per-question grades: evaluate it again with this vlmkit "
                             "(eval --split test --num 6300 --json)")
    if run["questions_sha1"] != shipped["questions_sha1"]:
        raise ValueError("the two evals asked different questions (questions_sha1 differs: another --seed, or the "
                         "data generator changed): evaluate both with this vlmkit")
    run_tasks, shipped_tasks = run["tasks"], shipped["tasks"]
    missing = sorted(set(shipped_tasks) - set(run_tasks))
    if missing:
        raise ValueError(f"the run's eval lacks tasks {missing}: evaluate it on the same tasks as the shipped model")
    scores = {name: (per_question(run_tasks, name), per_question(shipped_tasks, name)) for name in GAIN_TASKS}
    paired = {name: paired_difference(*pair) for name, pair in scores.items()}
    checks = [("minutes", minutes <= MAX_MINUTES, f"{minutes:.1f} min (limit {MAX_MINUTES})")]
    for name in MUST_NOT_DROP + ("grounding IoU",):
        new, old = headline(run_tasks, name), headline(shipped_tasks, name)
        d, se = paired[name]
        detail = (f"{new:.3f} vs shipped {old:.3f}: paired {d:+.4f}, se {se:.4f} (at least {-MAX_DROP_SE * se:+.4f}; "
                  f"unpaired se {unpaired_standard_error(*scores[name]):.4f})")
        checks.append((name, d >= -MAX_DROP_SE * se - 1e-12, detail))
    for name in MAY_DROP_2_POINTS:
        new, old = headline(run_tasks, name), headline(shipped_tasks, name)
        checks.append((name, new >= old - 0.02, f"{new:.3f} vs shipped {old:.3f} (at least {old - 0.02:.3f})"))
    new = run_tasks["motion"]["accuracy"]
    checks.append(("motion", new >= MIN_MOTION, f"{new:.3f} (at least {MIN_MOTION})"))
    for name, task in run_tasks.items():
        if "accuracy_heldout" in task and name in shipped_tasks:
            limit = max(0.10, held_out_gap(shipped_tasks[name]) + 0.02)
            gap = held_out_gap(task)
            checks.append((f"{name} held-out gap", gap <= limit + 1e-9, f"{gap:+.3f} (at most {limit:+.3f})"))
    for name, task in run_tasks.items():
        if name in shipped_tasks:
            limit = max(0.05, blank_lift(shipped_tasks[name]) + 0.02)
            lift = blank_lift(task)
            checks.append((f"{name} blank - majority", lift <= limit + 1e-9, f"{lift:+.3f} (at most {limit:+.3f})"))
    gains = {name: d / se for name, (d, se) in paired.items() if se > 0}
    best = max(gains, key=gains.get, default=None)
    checks.append(("a clear gain", best is not None and gains[best] > MIN_GAIN_SE,
                   f"largest: {best} at {gains[best]:+.1f} se (more than {MIN_GAIN_SE:.0f} needed)" if best
                   else "every task answered question for question as the shipped model did"))
    return checks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_eval", type=Path, help="`vlmkit --model RUN eval --split test --num 6300 --json` output")
    parser.add_argument("training_log", type=Path, help="the run's training_log.json (its `minutes`)")
    parser.add_argument("--shipped", type=Path, default=DEFAULT_SHIPPED)
    args = parser.parse_args(argv)
    run, shipped = json.loads(args.run_eval.read_text()), json.loads(args.shipped.read_text())
    minutes = json.loads(args.training_log.read_text())["minutes"]
    for name, task in run["tasks"].items():
        old = shipped["tasks"].get(name, {})
        print(f"{name:10s} {task['accuracy']:.3f} (seen {task.get('accuracy_seen', float('nan')):.3f}, held-out "
              f"{task.get('accuracy_heldout', float('nan')):.3f}, blank {task['blank_accuracy']:.3f}, majority "
              f"{task['majority_rate']:.3f})  shipped {old.get('accuracy', float('nan')):.3f}")
        if "hits" in task and "hits" in old:
            print("           right in both {}, run only {}, shipped only {}, wrong in both {}".format(
                *agreement(task["hits"], old["hits"])))
    checks = ship_checks(run, shipped, minutes)
    for name, passed, detail in checks:
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}")
    ships = all(passed for _, passed, _ in checks)
    print("ships" if ships else f"does not ship: {sum(not p for _, p, _ in checks)} check(s) failed")
    return 0 if ships else 1


if __name__ == "__main__":
    sys.exit(main())

"""How well does stage 1's tower know each shape, rather than each token? (a stage-1 cache's heads)

    python examples/probe_tower_shapes.py --stage1-cache stage1.pt [--scenes 480] [--json out.json]

`train_shapes.py`'s stage-1 probe scores every merged token that shows a shape: 83% of them get the
shape's kind right after the shipped 5,000 steps, 95% its colour. The language model reads shapes,
not tokens. A token that shows a shape's corner may be unreadable while another of its tokens is
plain, or a shape may be read wrong in all its tokens. This probe loads a stage-1 cache
(`train_shapes.py --stage1-cache`: the model and stage 1's name-scored heads), runs the tower on
validation scenes (the stills `train_shapes.py` measures stage 1 on, and the same scenes with every
shape in its held-out colour-kind pair), and scores the kind and colour of each shape:
- "tokens": the share of the shape's tokens that name it right (the stage-1 probe's measure, but with
  every shape weighing the same);
- "pooled": the argmax of the summed logits of its tokens, what a reader of all of them could get;
- "unclaimed": shapes no token shows (`cell_owners`: another shape claims their cells, or they are
  too small a share of every cell); the language model cannot name those from any one token.
Broken down by kind, by size, by how many tokens show the shape and by the scene's shapes, with
what the wrong kinds were read as.
"""

import argparse
import json
import os
import sys
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_shapes  # the example next to this one: tokenizer, model, stage-1 heads
from vlmkit.data.shapes import COLOURS, KINDS, cell_owners

NAMED = ("kind", "colour")


def load_stage1(path: str):
    """The model, processor and stage-1 heads of a `train_shapes.py --stage1-cache` file."""
    cached = torch.load(path)
    tokenizer = train_shapes.shapes_tokenizer()
    model, processor = train_shapes.build_model_and_processor(tokenizer, smoke=False)
    model.load_state_dict(cached["model"])
    heads = train_shapes.NameHeads.from_state(model, processor, train_shapes.cached_stage1_options(cached), cached["heads"])
    return model.eval(), processor, heads.eval()


@torch.no_grad()
def shape_reads(model, processor, heads, samples: list[dict], batch_size: int = 32) -> list[dict]:
    """One row per shape of `samples`: its kind, size, tokens, and per named head the share of its
    tokens right and whether its pooled logits are right."""
    image_processor = processor.image_processor
    cell = image_processor.patch_size * image_processor.merge_size  # px each merged token sees
    rows = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        inputs = image_processor(images=[s["image"] for s in batch], return_tensors="pt")
        tokens = model.model.visual(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output  # (N, D)
        logits = heads(tokens)
        offset = 0
        for sample in batch:
            scene = sample["scene"]
            owner = torch.from_numpy(cell_owners(scene, cell=cell).reshape(-1))  # (rows*cols,): row-major, as the tokens
            here = slice(offset, offset + len(owner))
            offset += len(owner)
            for index, shape in enumerate(scene["shapes"]):
                mine = owner == index
                row = {"kind": shape["kind"], "size": shape["size"], "tokens": int(mine.sum()), "shapes": len(scene["shapes"])}
                truth = {"kind": KINDS.index(shape["kind"]), "colour": list(COLOURS).index(shape["colour"])}
                for name in NAMED:
                    scores = logits[name][here][mine]  # (tokens, classes)
                    if len(scores):
                        row[f"{name}_tokens"] = (scores.argmax(-1) == truth[name]).float().mean().item()
                        pooled = scores.sum(0).argmax().item()
                        row[f"{name}_pooled"] = int(pooled == truth[name])
                        row[f"{name}_read_as"] = pooled
                rows.append(row)
        if offset != len(tokens):
            raise ValueError(f"{len(tokens)} merged tokens for {offset} image cells: the tower is not spatial")
    return rows


def summary(rows: list[dict]) -> dict:
    """Per named head, over the shapes some token shows: mean token share right and pooled accuracy;
    and the share of shapes no token shows."""
    claimed = [r for r in rows if r["tokens"]]
    out = {"shapes": len(rows), "unclaimed": round(1 - len(claimed) / len(rows), 4) if rows else 0.0}
    for name in NAMED:
        if claimed:
            out[f"{name}_tokens"] = round(sum(r[f"{name}_tokens"] for r in claimed) / len(claimed), 4)
            out[f"{name}_pooled"] = round(sum(r[f"{name}_pooled"] for r in claimed) / len(claimed), 4)
    # what the wrong pooled kinds were read as (the most common three; "background": no kind at all)
    misread = Counter((KINDS + ("background",))[r["kind_read_as"]] for r in claimed if not r["kind_pooled"])
    out["kind_misread_as"] = dict(misread.most_common(3))
    return out


def breakdowns(rows: list[dict]) -> dict:
    groups = {"all": {"all": rows}}
    for key, label in (("kind", str), ("size", str), ("tokens", lambda n: str(min(n, 4)) + ("+" if n >= 4 else "")),
                       ("shapes", str)):
        split = defaultdict(list)
        for r in rows:
            split[label(r[key])].append(r)
        groups[f"by_{key}"] = dict(sorted(split.items()))
    return {group: {k: summary(v) for k, v in parts.items()} for group, parts in groups.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage1-cache", required=True, help="a train_shapes.py --stage1-cache file")
    parser.add_argument("--scenes", type=int, default=480, help="validation scenes (each also in held-out pairs)")
    parser.add_argument("--json", help="write the breakdowns here")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not os.path.exists(args.stage1_cache):
        parser.error(f"--stage1-cache {args.stage1_cache}: no such file")
    torch.set_num_threads(args.threads)
    model, processor, heads = load_stage1(args.stage1_cache)
    seeds = list(range(args.scenes))
    sets = {"seen": train_shapes.dense_samples(seeds, split="validation"),
            "heldout_pairs": train_shapes.heldout_pair_samples(seeds)}
    report = {"stage1_cache": args.stage1_cache, "scenes": args.scenes,
              **{name: breakdowns(shape_reads(model, processor, heads, samples)) for name, samples in sets.items()}}
    for name in sets:
        print(f"## {name}")
        print("| group | shapes | unclaimed | kind: tokens / pooled | colour: tokens / pooled | wrong kinds read as |")
        print("|---|---|---|---|---|---|")
        for group, parts in report[name].items():
            for key, s in parts.items():
                print(f"| {group} {key} | {s['shapes']} | {s['unclaimed']:.1%} | {s.get('kind_tokens', 0):.1%} / "
                      f"{s.get('kind_pooled', 0):.1%} | {s.get('colour_tokens', 0):.1%} / {s.get('colour_pooled', 0):.1%} | "
                      f"{', '.join(f'{k} {n}' for k, n in s['kind_misread_as'].items())} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

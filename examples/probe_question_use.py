"""Does a ShapesWorld model read the question? The blank-image baseline of `vlmkit eval` asks whether
the answers depend on the image; this asks whether they depend on which shape the question names.

    python examples/probe_question_use.py                    # the shipped model
    python examples/probe_question_use.py --model my_model --json

Two probes on validation scenes, answered greedily:
- two shapes, "What colour is the {kind}?" asked about each: a model that reads the kind names the
  two different colours; one that does not gives the same answer to both questions;
- one shape, "Is there a {colour} {kind}?" asked three ways: the shape itself (truth "yes"), its kind
  in another colour and its colour on another kind (truth "no"). A model that ignores the question
  says "yes" equally often to all three; one that checks colour only says "yes" to the third;
- and below the language model, whether the visual tokens still carry the kind and colour in its
  words: on validation images, the share of shape tokens whose nearest name by cosine similarity
  to the language model's embeddings of the kind names (" star") and colour names (" red") is the
  shape's own. Stage 1 of train_shapes.py trains exactly this alignment; this shows how much of it
  survives stage 2;
- composition: one-shape test scenes of seen and of held-out colour-kind pairs (never in training),
  "What colour is the {kind}?" answered, and the same alignment of their shape tokens. With one
  shape there is nothing to confuse it with: if the tokens still carry the colour's word but the
  answer is wrong, the language model reads the colour through the kind, not the tower;
- and the same scenes captioned from a given start up to the colour word, the shape's own or one
  that makes a seen pair with its kind: whether the colour word decides the kind written after it.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_shapes import dense_batch, dense_labels, name_token_ids  # noqa: E402  (stage 1's labels and name tokens)

from vlmkit.cli import answer_samples, load  # noqa: E402
from vlmkit.data import COLOURS, KINDS, SEEN_COMBOS, as_messages, make_sample  # noqa: E402


def two_shape_colour_questions(num_scenes: int) -> list[dict]:
    """Pairs of samples (same scene, one question per shape), for scenes of exactly two shapes."""
    samples, seed = [], 0
    while len(samples) < 2 * num_scenes:
        sample = make_sample(seed, task="colour", split="validation", difficulty=0, max_shapes=2)
        seed += 1
        if len(sample["scene"]["shapes"]) != 2:
            continue
        for shape in sample["scene"]["shapes"]:
            samples.append({**sample, "question": f"What colour is the {shape['kind']}?", "answer": shape["colour"]})
    return samples


def one_shape_existence_questions(num_scenes: int) -> list[dict]:
    """Triples of samples on one-shape scenes: the shape itself, another colour, another kind."""
    samples = []
    for i in range(num_scenes):
        sample = make_sample(i, task="colour", split="validation", difficulty=0, max_shapes=1)
        shape = sample["scene"]["shapes"][0]
        other_colour = [c for c in COLOURS if c != shape["colour"]][i % (len(COLOURS) - 1)]
        other_kind = [k for k in KINDS if k != shape["kind"]][i % (len(KINDS) - 1)]
        for colour, kind, answer in ((shape["colour"], shape["kind"], "yes"), (other_colour, shape["kind"], "no"),
                                     (shape["colour"], other_kind, "no")):
            samples.append({**sample, "task": "existence", "question": f"Is there a {colour} {kind}?", "answer": answer})
    return samples


def one_shape_colour_questions(num_scenes: int, heldout: bool) -> list[dict]:
    """One-shape test scenes of held-out (or of seen) colour-kind pairs, "What colour is the {kind}?"."""
    samples, seed = [], 0
    while len(samples) < num_scenes:
        sample = make_sample(seed, task="colour", split="test", heldout=heldout, difficulty=0, max_shapes=1)
        seed += 1
        if len(sample["scene"]["shapes"]) == 1:
            (shape,) = sample["scene"]["shapes"]
            samples.append({**sample, "question": f"What colour is the {shape['kind']}?", "answer": shape["colour"]})
    return samples


def visual_word_alignment(model, processor, num_images: int = 96, samples: list[dict] | None = None) -> dict:
    """Share of shape tokens (merged visual tokens on a shape) whose most cosine-similar kind name and
    colour name, among the language model's input embeddings of the names, are the shape's own; on
    `num_images` validation images, or on the images of `samples`."""
    if samples is None:
        pixel_values, grid, labels = dense_batch(processor, list(range(num_images)), split="validation")
    else:
        pixel_values, grid, labels = dense_labels(processor, samples)
    embeddings = model.get_input_embeddings().weight.detach().float()
    with torch.no_grad():
        tokens = model.model.visual(pixel_values.to(model.dtype), grid).pooler_output.float()  # (N, D)
    on_shape = labels[:, 0] < len(KINDS)
    directions = torch.nn.functional.normalize(tokens[on_shape], dim=-1)
    result = {"shape_tokens": int(on_shape.sum())}
    for column, (name, words) in enumerate((("kind", KINDS), ("colour", COLOURS))):
        names = torch.stack([embeddings[ids].mean(0) for ids in name_token_ids(processor.tokenizer, words)])  # (7, D)
        nearest = (directions @ torch.nn.functional.normalize(names, dim=-1).T).argmax(-1)
        result[name] = round((nearest == labels[on_shape, column]).float().mean().item(), 3)
    return result


def probe(model, processor, num_scenes: int = 40) -> dict:
    colour = two_shape_colour_questions(num_scenes)
    answers = answer_samples(model, processor, colour, batch_size=40, max_new_tokens=4)
    pairs = list(zip(answers[0::2], answers[1::2]))
    existence = one_shape_existence_questions(num_scenes)
    said = answer_samples(model, processor, existence, batch_size=40, max_new_tokens=4)
    yes = [[a == "yes" for a in said[k::3]] for k in range(3)]
    return {
        "two_shape_colour": {
            "scenes": num_scenes,
            "accuracy": round(sum(a == s["answer"] for a, s in zip(answers, colour)) / len(colour), 3),
            "answers_differ": round(sum(a != b for a, b in pairs) / num_scenes, 3),
        },
        "one_shape_existence_yes_rate": {
            "scenes": num_scenes,
            "the_shape": round(sum(yes[0]) / num_scenes, 3),
            "other_colour": round(sum(yes[1]) / num_scenes, 3),
            "other_kind": round(sum(yes[2]) / num_scenes, 3),
        },
        "visual_tokens_nearest_name": visual_word_alignment(model, processor),
        "one_shape_colour": {name: composition(model, processor, num_scenes, heldout)
                             for name, heldout in (("seen", False), ("held_out", True))},
        "caption_kind_after_colour": {name: caption_kind_after_colour(model, processor, num_scenes, heldout)
                                      for name, heldout in (("seen", False), ("held_out", True))},
    }


def seen_pair_colour(shape: dict) -> str:
    """The first palette colour other than the shape's own that makes a seen pair with its kind."""
    return next(c for c in COLOURS if c != shape["colour"] and (c, shape["kind"]) in SEEN_COMBOS)


def caption_kind_after_colour(model, processor, num_scenes: int, heldout: bool) -> dict:
    """The kind a caption names after its colour word. On the one-shape scenes of
    `one_shape_colour_questions`, the caption is asked for and its start given up to the colour word
    ("a large orange"), written two ways: with the shape's own colour, and with another colour that
    makes a seen pair with its kind. Returns the share of scenes whose next word is the shape's kind,
    each way. The image is the same: if a held-out pair's kind follows the other colour's word but not
    its own, the colour word, not the tower's tokens, keeps the language model from writing it."""
    scenes = one_shape_colour_questions(num_scenes, heldout)
    prompts, images, kinds = [], [], []
    for sample in scenes:
        (shape,) = sample["scene"]["shapes"]
        other = seen_pair_colour(shape)
        chat = processor.apply_chat_template(as_messages({**sample, "question": "Describe the image."}, include_answer=False),
                                             add_generation_prompt=True, tokenize=False)
        prompts += [f"{chat}a {shape['size']} {colour}" for colour in (shape["colour"], other)]
        images += [sample["image"]] * 2
        kinds.append(shape["kind"])
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    next_words = [(text.split() or [""])[0]
                  for text in processor.post_process_image_text_to_text(out[:, inputs["input_ids"].shape[1]:])]
    return {"scenes": num_scenes,
            "own_colour": round(sum(w == k for w, k in zip(next_words[0::2], kinds)) / num_scenes, 3),
            "seen_pair_colour": round(sum(w == k for w, k in zip(next_words[1::2], kinds)) / num_scenes, 3)}


def composition(model, processor, num_scenes: int, heldout: bool) -> dict:
    samples = one_shape_colour_questions(num_scenes, heldout)
    answers = answer_samples(model, processor, samples, batch_size=40, max_new_tokens=4)
    return {"scenes": num_scenes,
            "accuracy": round(sum(a == s["answer"] for a, s in zip(answers, samples)) / num_scenes, 3),
            "tokens_nearest_name": visual_word_alignment(model, processor, samples=samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    parser.add_argument("--scenes", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model, processor = load(args.model)
    report = probe(model, processor, args.scenes)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    colour, existence = report["two_shape_colour"], report["one_shape_existence_yes_rate"]
    print(f"two shapes, 'What colour is the <kind>?' about each ({colour['scenes']} scenes): "
          f"accuracy {colour['accuracy']:.0%}, the two answers differ in {colour['answers_differ']:.0%} of scenes")
    print(f"one shape, 'Is there a <colour> <kind>?' ({existence['scenes']} scenes), share answered yes: "
          f"the shape itself {existence['the_shape']:.0%}, its kind in another colour {existence['other_colour']:.0%}, "
          f"its colour on another kind {existence['other_kind']:.0%}")
    aligned = report["visual_tokens_nearest_name"]
    print(f"visual tokens on shapes ({aligned['shape_tokens']}) nearest the language model's word for their own "
          f"kind {aligned['kind']:.0%}, colour {aligned['colour']:.0%} (chance {1 / len(KINDS):.0%})")
    for name, entry in report["one_shape_colour"].items():
        tokens = entry["tokens_nearest_name"]
        print(f"one shape of a {name.replace('_', '-')} colour-kind pair (test, {entry['scenes']} scenes): colour answered "
              f"{entry['accuracy']:.0%}; its tokens nearest their own colour's word {tokens['colour']:.0%}, kind's {tokens['kind']:.0%}")
    for name, entry in report["caption_kind_after_colour"].items():
        print(f"one shape of a {name.replace('_', '-')} pair, caption given up to the colour word ({entry['scenes']} scenes): "
              f"kind written after its own colour {entry['own_colour']:.0%}, after a seen pair's colour {entry['seen_pair_colour']:.0%}")


if __name__ == "__main__":
    main()

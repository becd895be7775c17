"""The ShapesWorld model that ships inside the package: bundled, small, served by the pipeline, and
answering from the image rather than from the question alone."""

import os

from transformers import pipeline

import vlmkit
from vlmkit.cli import answer_samples, load
from vlmkit.data import as_messages, blank_like, grade, make_sample

ONE_WORD_TASKS = ("count", "colour", "existence", "position", "motion")


def test_checkpoint_is_bundled_and_at_most_25_mb():
    path = vlmkit.default_model_path()
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "chat_template.jinja"} <= files
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 * 2**20


def test_pipeline_on_the_default_model_gives_what_generate_gives():
    sample = make_sample(3, task="colour", split="test")
    pipe = pipeline("image-text-to-text", model=vlmkit.default_model_path())
    out = pipe(text=as_messages(sample, include_answer=False), max_new_tokens=8, return_full_text=False)
    model, processor = load(None)
    assert out[0]["generated_text"].strip() == answer_samples(model, processor, [sample], max_new_tokens=8)[0]


def test_one_word_answers_depend_on_the_image():
    """On 100 test questions, the real image must beat a blank one by at least 25 points: a model on the
    language-prior plateau scores the same on both."""
    model, processor = load(None)
    samples = [make_sample(1000 + i, task=task, split="test") for i in range(20) for task in ONE_WORD_TASKS]
    with_image = answer_samples(model, processor, samples, batch_size=40, max_new_tokens=6)
    blank = answer_samples(model, processor, [blank_like(s) for s in samples], batch_size=40, max_new_tokens=6)
    accuracy = sum(grade(s["task"], a, s["answer"]) for s, a in zip(samples, with_image)) / len(samples)
    blank_accuracy = sum(grade(s["task"], a, s["answer"]) for s, a in zip(samples, blank)) / len(samples)
    assert accuracy - blank_accuracy >= 0.25, (accuracy, blank_accuracy)

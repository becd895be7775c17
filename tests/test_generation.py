"""generate() against the reference, batching invariance and statelessness."""

import torch
from helpers import batch_inputs, sample


def _batch():
    return [
        sample(6).text(3).image(4, 6).text(4),
        sample(7).text(9),
        sample(8).text(2).image(6, 4).text(1).video(2, 4, 4).text(3),
    ]


def test_greedy_16_tokens_equal_reference_on_a_batch(pair):
    ref, ours = pair
    inputs = batch_inputs(_batch())
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected, got = ref.generate(**inputs, **kwargs), ours.generate(**inputs, **kwargs)
    assert got.shape[1] == inputs["input_ids"].shape[1] + 16
    assert torch.equal(expected, got)


def test_beam_search_equals_reference(pair):
    ref, ours = pair
    inputs = batch_inputs(_batch())
    for kwargs in (dict(num_beams=3), dict(num_beams=3, num_return_sequences=2)):
        kwargs.update(max_new_tokens=8, do_sample=False)
        assert torch.equal(ref.generate(**inputs, **kwargs), ours.generate(**inputs, **kwargs)), kwargs


def test_num_return_sequences_returns_each_samples_own_continuation_twice(pair):
    _, ours = pair
    inputs = batch_inputs(_batch())
    greedy = ours.generate(**inputs, max_new_tokens=8, do_sample=False)
    torch.manual_seed(0)
    twice = ours.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(twice[0::2], greedy) and torch.equal(twice[1::2], greedy)


def test_a_left_padded_batch_generates_what_each_row_generates_alone(pair):
    _, ours = pair
    samples = _batch()
    inputs = batch_inputs(samples)
    batched = ours.generate(**inputs, max_new_tokens=12, do_sample=False)
    width = inputs["input_ids"].shape[1]
    for row, s in enumerate(samples):
        alone_inputs = batch_inputs([s])
        alone = ours.generate(**alone_inputs, max_new_tokens=12, do_sample=False)
        assert torch.equal(batched[row, width:], alone[0, alone_inputs["input_ids"].shape[1]:]), row


def test_consecutive_generate_calls_equal_fresh_models(reference_checkpoint, load_ours):
    """No per-call state on the module: A then B then a training forward equal fresh models."""
    path, _ = reference_checkpoint
    a_inputs = batch_inputs([sample(20).text(2).image(8, 4).text(3), sample(21).text(6)])
    b_inputs = batch_inputs([sample(22).text(4).video(2, 4, 6).text(2)])
    used = load_ours(path)
    a_then = used.generate(**a_inputs, max_new_tokens=8, do_sample=False)
    b_then = used.generate(**b_inputs, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        b_logits_then = used(**b_inputs).logits
    assert torch.equal(a_then, load_ours(path).generate(**a_inputs, max_new_tokens=8, do_sample=False))
    fresh = load_ours(path)
    assert torch.equal(b_then, fresh.generate(**b_inputs, max_new_tokens=8, do_sample=False))
    with torch.no_grad():
        assert torch.equal(b_logits_then, load_ours(path)(**b_inputs).logits)
    assert not any(isinstance(v, torch.Tensor) for k, v in vars(used.model).items() if "rope" in k)


def test_generate_step_scores_equal_the_forward_logits(pair):
    _, ours = pair
    inputs = batch_inputs([sample(30).text(3).image(4, 6).text(2).video(2, 4, 4).text(3)])
    out = ours.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = {k: v for k, v in inputs.items()}
    full["input_ids"] = out.sequences
    full["attention_mask"] = torch.ones_like(out.sequences)
    full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, 6))
    with torch.no_grad():
        teacher = ours(**full).logits
    prompt = inputs["input_ids"].shape[1]
    for step, logits in enumerate(out.logits):
        assert (logits[0] - teacher[0, prompt - 1 + step]).abs().max().item() <= 1e-5, step

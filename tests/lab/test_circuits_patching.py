"""Activation and attribution patching (multihead.lab.circuits.patching) against transformers' own eager attention.

The reference patches a tiny random GPT-2 and Llama (GQA, RoPE) through transformers' eager attention function,
wrapped so that one head's (or one position's) q, k, v, weights or output is taken from the clean run, one site
per forward: none of our hooks, kernels or batching takes part. Our sweep runs the same weights with
attn_implementation="multihead", many sites per forward. In float64 the scores agree to 1e-11 on GPT-2; on Llama
to 1e-5, since its eager attention takes the softmax in float32.
"""

from __future__ import annotations

import copy
import importlib
from contextlib import contextmanager

import pytest
import torch

from multihead.integrations import transformers as integration
from multihead.lab.circuits import PatchingResult, activation_patching, agreement, attribution_patching, path_patching
from support import is_input_error
from test_integrations_transformers import VOCAB, build, build_gemma2

ANSWER, WRONG = 5, 11
# how far transformers' eager attention is from float64 (Llama's takes its softmax in float32), in the logits and
# in the scores (measured: 1e-14 and 3e-7 at most)
EAGER_ROUNDING = {"gpt2": 1e-10, "llama": 1e-6, "mistral": 1e-6, "gpt_neox": 1e-6, "gemma2": 1e-6, "qwen2": 1e-6}
SCORE_TOLERANCE = {"gpt2": 1e-11, "llama": 1e-5, "mistral": 1e-5, "gpt_neox": 1e-5, "gemma2": 1e-5, "qwen2": 1e-5}
LENGTH = 7


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two clean prompts (2, LENGTH) and their corruption: tokens 2 and 4 changed."""
    generator = torch.Generator().manual_seed(3)
    clean = torch.randint(3, VOCAB, (2, LENGTH), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 17) % VOCAB
    corrupt[:, 4] = (corrupt[:, 4] + 29) % VOCAB
    return clean, corrupt


def build_any(name: str) -> torch.nn.Module:
    """A tiny random causal LM of architecture ``name``: those test_integrations_transformers builds, and Gemma 2
    (soft-capped scores, a window in every other layer)."""
    return build_gemma2() if name == "gemma2" else build(name)


def pair(name: str):
    """(eager, multihead) copies of a tiny random model, float64, eval mode, and its transformers module."""
    theirs = build_any(name).to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours, importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@contextmanager
def eager_sites(module, on_call):
    """Wrap the architecture's eager attention: ``on_call(layer, query, key, value, run)`` may return new q, k, v
    and gets ``run(q, k, v) -> (output (b, i, h, e), weights)``, transformers' own computation."""
    original = module.eager_attention_forward

    def wrapped(attention, query, key, value, *rest, **kwargs):
        def run(q, k, v):
            return original(attention, q, k, v, *rest, **kwargs)

        return on_call(attention.layer_idx, query, key, value, run)

    module.eager_attention_forward = wrapped
    try:
        yield
    finally:
        module.eager_attention_forward = original


def reference_scores(model, module, clean, corrupt, what: str, by: str) -> torch.Tensor:
    """The scores of patching each site alone, on transformers' eager attention: (layers, heads or positions)."""
    recorded: dict[int, dict[str, torch.Tensor]] = {}

    def recording(layer, q, k, v, run):
        out, weights = run(q, k, v)
        recorded[layer] = {"q": q, "k": k, "v": v, "pattern": weights, "z": out.transpose(1, 2)}
        return out, weights

    def difference(ids):
        last = model(ids).logits[:, -1]
        return float((last[:, ANSWER] - last[:, WRONG]).mean())

    with torch.no_grad():
        with eager_sites(module, recording):
            clean_difference = difference(clean)
        corrupt_difference = difference(corrupt)

    def patched(layer_patched, index):
        def take(tensor, source):
            tensor = tensor.clone()
            if by == "head":
                tensor[:, index] = source[:, index]
            else:
                tensor[:, :, index] = source[:, :, index]
            return tensor

        def patching(layer, q, k, v, run):
            source = recorded[layer]
            if layer != layer_patched:
                return run(q, k, v)
            if what in ("q", "k", "v"):
                q, k, v = (
                    take(t, source[name]) if name == what else t for name, t in zip("qkv", (q, k, v), strict=True)
                )
                return run(q, k, v)
            out, weights = run(q, k, v)
            if what == "z":
                return take(out.transpose(1, 2), source["z"]).transpose(1, 2), weights
            weights = take(weights, source["pattern"])  # the clean pattern over this run's values
            groups = weights.shape[1] // v.shape[1]
            return (weights @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), weights

        with torch.no_grad(), eager_sites(module, patching):
            return difference(corrupt)

    shapes = recorded[0][what if what != "pattern" else "q"].shape  # (b, heads, positions, ...)
    count = shapes[1] if by == "head" else shapes[2]
    layers = len(recorded)
    scores = torch.empty(layers, count, dtype=torch.float64)
    for layer in range(layers):
        for index in range(count):
            scores[layer, index] = (patched(layer, index) - corrupt_difference) / (
                clean_difference - corrupt_difference
            )
    return scores


@pytest.mark.parametrize("by", ["head", "position"])
@pytest.mark.parametrize("what", ["z", "pattern", "q", "k", "v"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_exact_patching_equals_patching_transformers_eager_attention(name, what, by):
    theirs, ours, module = pair(name)
    clean, corrupt = prompts()
    expected = reference_scores(theirs, module, clean, corrupt, what, by)
    result = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what=what, by=by, batch_size=3)
    assert isinstance(result, PatchingResult) and result.method == "exact" and result.part == "self"
    assert result.scores.shape == expected.shape
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=SCORE_TOLERANCE[name])
    # positions before the first corrupted token carry nothing to restore (causal: they never see it)
    if by == "position":
        assert result.scores[:, :2].abs().max() < 1e-9
    # the sweep leaves the model as it was: hooks removed, mode back, the same logits
    assert all(not site.attend._forward_hooks and not site.attend._forward_pre_hooks for site in sites(ours))
    torch.testing.assert_close(ours(clean).logits, theirs(clean).logits, rtol=0, atol=EAGER_ROUNDING[name])


@pytest.mark.parametrize("what, by", [("z", "head"), ("pattern", "head"), ("v", "position")])
@pytest.mark.parametrize("name", ["mistral", "gpt_neox", "gemma2", "qwen2"])
def test_exact_patching_on_the_other_architectures(name, what, by):
    # a window (Mistral, Gemma 2), soft-capped scores (Gemma 2), partial rotary (GPT-NeoX), q/k/v biases (Qwen2)
    theirs, ours, module = pair(name)
    clean, corrupt = prompts()
    expected = reference_scores(theirs, module, clean, corrupt, what, by)
    result = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what=what, by=by, batch_size=4)
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=SCORE_TOLERANCE[name])
    assert result.scores.abs().max() > 1e-3  # the corruption moves something: the comparison is not of zeros


def sites(model):
    from multihead.capture import attention_sites

    return attention_sites(model)


@pytest.mark.parametrize("what", ["z", "pattern", "q", "k", "v"])
def test_attribution_patching_is_the_derivative_along_the_patch(what):
    # AtP's numerator for a site is d metric / d t at t = 0 of the corrupted run with that site moved to
    # corrupt + t (clean - corrupt): measured here by central differences on transformers' eager attention
    theirs, ours, module = pair("gpt2")  # its eager softmax is in float64: central differences stay exact
    clean, corrupt = prompts()
    estimate = attribution_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what=what)
    recorded: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def recorder(run_name):
        def recording(layer, q, k, v, run):
            out, weights = run(q, k, v)
            recorded[run_name, layer] = {"q": q, "k": k, "v": v, "pattern": weights, "z": out.transpose(1, 2)}
            return out, weights

        return recording

    def difference(ids):
        last = theirs(ids).logits[:, -1]
        return float((last[:, ANSWER] - last[:, WRONG]).mean())

    with torch.no_grad():
        for run_name, ids in (("clean", clean), ("corrupt", corrupt)):
            with eager_sites(module, recorder(run_name)):
                difference(ids)
    span = estimate.clean - estimate.corrupt

    def moved(layer_moved, head, t):
        def moving(layer, q, k, v, run):
            if layer != layer_moved:
                return run(q, k, v)
            start, end = recorded["corrupt", layer], recorded["clean", layer]

            def along(tensor, name):
                tensor = tensor.clone()
                tensor[:, head] = start[name][:, head] + t * (end[name][:, head] - start[name][:, head])
                return tensor

            if what in ("q", "k", "v"):
                q, k, v = (along(x, name) if name == what else x for name, x in zip("qkv", (q, k, v), strict=True))
                return run(q, k, v)
            out, weights = run(q, k, v)
            if what == "z":
                return along(out.transpose(1, 2), "z").transpose(1, 2), weights
            weights = along(weights, "pattern")
            groups = weights.shape[1] // v.shape[1]
            return (weights @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), weights

        with torch.no_grad(), eager_sites(module, moving):
            return difference(corrupt)

    step = 1e-4
    for layer in range(estimate.scores.shape[0]):
        for head in range(estimate.scores.shape[1]):
            derivative = (moved(layer, head, step) - moved(layer, head, -step)) / (2 * step)
            assert float(estimate.scores[layer, head]) == pytest.approx(derivative / span, abs=1e-6)


def test_attribution_agrees_with_exact_patching_on_a_small_model():
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    exact = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG)
    cheap = attribution_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG)
    found = agreement(exact, cheap, top=3)
    # a random tiny model is nearly linear in each head's output: the first-order estimate ranks the heads alike
    assert found.correlation > 0.9 and found.top == 3
    assert agreement(exact, exact).correlation == pytest.approx(1.0)


def test_a_sweep_costs_one_forward_per_batch_of_sites():
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    calls = []
    handle = ours.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(args[0].shape[0]), with_kwargs=True
    )
    try:
        activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, batch_size=3)  # 2 layers x 4 heads
    finally:
        handle.remove()
    # the clean and corrupted runs, then ceil(8 / 3) forwards of 3, 3 and 2 copies of the two prompts
    assert calls == [2, 2, 6, 6, 4]


def test_progress_is_told_after_each_forward():
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    told = []
    activation_patching(
        ours, clean, corrupt, answer=ANSWER, wrong=WRONG, batch_size=5, progress=lambda *d: told.append(d)
    )
    assert told == [(1, 2), (2, 2)]


def test_results_say_what_they_are_in_json():
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    data = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, by="position").to_dict()
    assert data["what"] == "z" and data["by"] == "position" and data["method"] == "exact"
    assert len(data["scores"]) == 2 and len(data["scores"][0]) == LENGTH
    assert data["clean_logit_difference"] != data["corrupt_logit_difference"]


@pytest.mark.parametrize(
    "change, kind, fragment",
    [
        (dict(what="attn"), ValueError, "what: expected one of ['z', 'pattern', 'q', 'k', 'v']"),
        (dict(by="layer"), ValueError, "by: expected one of ['head', 'position']"),
        (dict(answer=VOCAB), ValueError, "answer: expected token ids in [0, 97)"),
        (dict(wrong=ANSWER), ValueError, "wrong: expected a token other than the answer"),
        (dict(answer="5"), TypeError, "answer: expected a token id (int)"),
        (dict(corrupt_ids="the prompt"), TypeError, "corrupt_ids: expected token ids"),
        (dict(corrupt_ids=torch.zeros(2, LENGTH + 1, dtype=torch.long)), ValueError, "corrupt_ids: expected the shape"),
        (dict(batch_size=0), ValueError, "batch_size: expected a positive int"),
        (dict(part="cross"), ValueError, "part: expected one of the model's parts"),
    ],
)
def test_bad_arguments_are_named(change, kind, fragment):
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    arguments = dict(clean_ids=clean, corrupt_ids=corrupt, answer=ANSWER, wrong=WRONG) | change
    ours.train()
    with pytest.raises(kind) as raised:
        activation_patching(ours, **arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)
    assert ours.training  # the mode comes back after a refusal too


def test_a_corruption_that_changes_nothing_is_refused():
    _, ours, _ = pair("gpt2")
    clean, _ = prompts()
    with pytest.raises(ValueError, match="corrupt_ids: expected a prompt whose logit difference differs"):
        activation_patching(ours, clean, clean.clone(), answer=ANSWER, wrong=WRONG)


def reference_path_scores(model, module, clean, corrupt, receivers, what: str) -> torch.Tensor:
    """Path patching on transformers' eager attention, one sender per pair of forwards: the sender's output from
    the clean run and every other head's held at its corrupted value, the receivers' ``what`` recorded; then
    the corrupted run with only those replaced. (layers, heads), NaN where a head cannot send."""
    recorded: dict[tuple[str, int], torch.Tensor] = {}

    def recorder(run_name):
        def recording(layer, q, k, v, run):
            out, weights = run(q, k, v)
            recorded[run_name, layer] = out.transpose(1, 2)  # (b, h, i, e)
            return out, weights

        return recording

    def difference(ids):
        last = model(ids).logits[:, -1]
        return float((last[:, ANSWER] - last[:, WRONG]).mean())

    with torch.no_grad():
        with eager_sites(module, recorder("clean")):
            clean_difference = difference(clean)
        with eager_sites(module, recorder("corrupt")):
            corrupt_difference = difference(corrupt)
    first = min(layer for layer, _ in receivers)
    heads = recorded["clean", 0].shape[1]
    layers = len({layer for _, layer in recorded})
    scores = torch.full((layers, heads), float("nan"), dtype=torch.float64)
    position = "qkv".index(what)
    for sender_layer in range(first):
        for sender in range(heads):
            seen: dict[int, torch.Tensor] = {}

            def sending(layer, q, k, v, run, seen=seen, sender_layer=sender_layer, sender=sender):
                seen[layer] = (q, k, v)[position]
                _, weights = run(q, k, v)
                z = recorded["corrupt", layer].clone()
                if layer == sender_layer:
                    z[:, sender] = recorded["clean", layer][:, sender]
                return z.transpose(1, 2), weights

            with torch.no_grad(), eager_sites(module, sending):
                model(corrupt)

            def receiving(layer, q, k, v, run, seen=seen):
                inputs = [q, k, v]
                for receiver_layer, head in receivers:
                    if receiver_layer == layer:
                        index = head if what == "q" else head // (q.shape[1] // k.shape[1])
                        inputs[position] = inputs[position].clone()
                        inputs[position][:, index] = seen[layer][:, index]
                return run(*inputs)

            with torch.no_grad(), eager_sites(module, receiving):
                patched = difference(corrupt)
            scores[sender_layer, sender] = (patched - corrupt_difference) / (clean_difference - corrupt_difference)
    return scores


@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_path_patching_equals_path_patching_transformers_eager_attention(name, what):
    theirs, ours, module = pair(name)
    clean, corrupt = prompts()
    receivers = [(1, 0), (1, 3)]
    expected = reference_path_scores(theirs, module, clean, corrupt, receivers, what)
    result = path_patching(
        ours, clean, corrupt, answer=ANSWER, wrong=WRONG, receivers=receivers, what=what, batch_size=3
    )
    assert result.method == "path" and result.what == what and result.scores.shape == expected.shape
    assert bool(result.scores[1].isnan().all()) and not bool(result.scores[0].isnan().any())
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=SCORE_TOLERANCE[name], equal_nan=True)


@pytest.mark.parametrize(
    "receivers, kind, fragment",
    [
        ([], TypeError, "receivers: expected a non-empty list"),
        ([(1, 9)], ValueError, "receivers: expected heads of the model's 2 layers"),
        ([(0, 1)], ValueError, "receivers: expected heads after layer 0"),
        ([(1, 1), (1, 1)], ValueError, "receivers: expected each head once"),
        ([1], TypeError, "receivers: expected (layer, head) pairs"),
    ],
)
def test_path_patching_names_bad_receivers(receivers, kind, fragment):
    _, ours, _ = pair("gpt2")
    clean, corrupt = prompts()
    with pytest.raises(kind) as raised:
        path_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, receivers=receivers)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_chosen_sites_alone_are_patched_with_the_sweeps_scores():
    _, ours, _ = pair("llama")
    clean, corrupt = prompts()
    every = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what="k")
    chosen = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what="k", sites=[(1, 1), (0, 0)])
    assert int((~chosen.scores.isnan()).sum()) == 2
    for layer, head in [(1, 1), (0, 0)]:
        assert float(chosen.scores[layer, head]) == pytest.approx(float(every.scores[layer, head]), abs=1e-12)
    for sites, kind, fragment in (
        ([(1, 2)], ValueError, "sites: expected (layer, head) pairs of this model"),  # k: 2 key/value heads
        ([(0, 1), (0, 1)], ValueError, "sites: expected each pair once"),
        ([], TypeError, "sites: expected a non-empty list"),
    ):
        with pytest.raises(kind, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what="k", sites=sites)


@pytest.mark.parametrize(("clean", "corrupt", "noted"), [(0.031, 0.034, True), (-0.04, 0.05, True), (2.0, -1.5, False)])
def test_the_page_notes_when_clean_minus_corrupt_is_too_small_to_divide_by(clean, corrupt, noted):
    """Issue 47, row 17: shares of a 0.003-nat difference print with a note; a readable difference prints none."""
    from multihead.lab.circuits.report import SMALL_DIFFERENCE, patching_page

    result = PatchingResult("z", "head", "attention", "exact", torch.tensor([[-2.86, 4.71]]), clean, corrupt)
    notes = patching_page(result).notes
    small = [note for note in notes if "too noisy to read" in note]
    assert bool(small) == noted
    if noted:
        assert small[0].startswith(f"note: clean - corrupt is only {abs(clean - corrupt):.3g} nats")
        assert f"under {SMALL_DIFFERENCE}" in small[0] and "Fix:" in small[0]

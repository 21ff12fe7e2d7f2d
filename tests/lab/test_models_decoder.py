"""multihead.lab.models.decoder: the GPT-style decoder, its KV-cached generation, training, saving and capture.

The reference for cached decoding is the same model recomputing the whole prefix at every step
(``use_cache=False``); the comparisons run in float64 so that they test the cache, not rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead._errors import InputError
from multihead.lab.inspect import capture
from multihead.lab.models import Decoder, DecoderCache, DecoderConfig, load_decoder

VOCAB = 23


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


def make_model(*, positions="rotary", kv_heads=None, mlp=40, seed=0, dtype=torch.float64, **overrides) -> Decoder:
    """A 2-layer, 6-head decoder of width 24 (untied unless asked); embeddings and head scaled up so that
    the logits are far from uniform and the samples varied."""
    fields = dict(vocab_size=VOCAB, max_positions=19, hidden=24, layers=2, heads=6, kv_heads=kv_heads, mlp=mlp)
    fields.update(positions=positions, tie_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(**fields)).to(dtype)
    with torch.no_grad():
        model.token_embeddings.weight.normal_(0.0, 1.0)
        if model.lm_head is not None:
            model.lm_head.weight.normal_(0.0, 0.3)
    return model.eval()


def prompt(b=3, n=5, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


VARIANTS = [
    pytest.param(positions, kv_heads, mlp, id=f"{positions}-{'gqa' if kv_heads else 'mha'}-{'mlp' if mlp else 'attn'}")
    for positions in ("rotary", "learned")
    for kv_heads in (None, 2)
    for mlp in (None, 40)
]


# ------------------------------------------------------------------------------ the KV cache


@pytest.mark.parametrize(("positions", "kv_heads", "mlp"), VARIANTS)
def test_cached_generation_equals_uncached(positions, kv_heads, mlp):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    ids = prompt()
    greedy = model.generate(ids, 11, use_cache=True)
    assert torch.equal(greedy, model.generate(ids, 11, use_cache=False))
    assert greedy.shape == (3, 16) and torch.equal(greedy[:, :5], ids)
    sampled = model.generate(ids, 11, temperature=1.3, seed=7, use_cache=True)
    assert torch.equal(sampled, model.generate(ids, 11, temperature=1.3, seed=7, use_cache=False))
    top_k = model.generate(ids, 11, temperature=0.9, top_k=4, seed=3, use_cache=True)
    assert torch.equal(top_k, model.generate(ids, 11, temperature=0.9, top_k=4, seed=3, use_cache=False))
    # not vacuous: the new tokens vary, and sampling differs from greedy
    assert len(set(greedy[:, 5:].flatten().tolist())) > 2
    assert not torch.equal(sampled, greedy)


def test_sampling_is_reproducible_with_a_seed_and_varies_without_one():
    model = make_model(dtype=torch.float32)
    ids = prompt()
    first = model.generate(ids, 12, temperature=1.0, seed=11)
    assert torch.equal(first, model.generate(ids, 12, temperature=1.0, seed=11))
    assert not torch.equal(first, model.generate(ids, 12, temperature=1.0, seed=12))


def test_top_k_samples_only_among_the_k_most_likely():
    model = make_model()
    ids = prompt(b=2, n=4)
    out = model.generate(ids, 1, temperature=5.0, top_k=2, seed=0)
    best_two = model(ids)[:, -1].topk(2).indices  # (b, 2)
    assert all(out[row, -1] in best_two[row] for row in range(2))
    # greedy is the argmax at every step
    greedy = model.generate(ids, 3)
    for step in range(3):
        assert torch.equal(greedy[:, 4 + step], model(greedy[:, : 4 + step])[:, -1].argmax(-1))


@pytest.mark.parametrize(("positions", "kv_heads", "mlp"), VARIANTS[::3])
def test_cached_forward_logits_equal_the_full_forward(positions, kv_heads, mlp):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    ids = prompt(b=2, n=13, seed=5)
    full = model(ids)  # (b, n, vocab)
    cache = model.new_cache(2, 17)
    chunks = []
    for start, end in ((0, 4), (4, 5), (5, 8), (8, 13)):
        chunks.append(model(ids[:, start:end], cache=cache))
        assert cache.seen == end
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-10, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(
    positions=st.sampled_from(["rotary", "learned"]),
    kv_heads=st.sampled_from([1, 2, 3, 6]),
    mlp=st.sampled_from([0, 17]),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),  # at most 16 <= max_positions
    batch=st.integers(1, 3),
)
def test_any_split_into_cached_chunks_gives_the_full_forward(positions, kv_heads, mlp, chunks, batch):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    ids = prompt(b=batch, n=sum(chunks), seed=len(chunks))
    cache = model.new_cache(batch, sum(chunks))
    pieces, start = [], 0
    for size in chunks:
        pieces.append(model(ids[:, start : start + size], cache=cache))
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(ids), rtol=1e-10, atol=1e-10)


def test_a_refused_cached_call_leaves_the_cache_as_it_was():
    model = make_model()
    cache = model.new_cache(2, 6)
    model(prompt(b=2, n=4), cache=cache)
    with pytest.raises(ValueError, match="cache"):
        model(prompt(b=2, n=3), cache=cache)  # 4 + 3 > 6
    assert cache.seen == 4 and all(len(layer) == 4 for layer in cache.layers)
    with pytest.raises(ValueError, match="cache"):
        model(prompt(b=3, n=1), cache=cache)  # wrong batch size
    with pytest.raises(TypeError, match="cache"):
        model(prompt(b=2, n=1), cache=cache.layers)
    assert cache.seen == 4
    cache.reset()
    assert cache.seen == 0 and isinstance(cache, DecoderCache)


# ------------------------------------------------------------------------------ causality and training


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_changing_a_later_token_never_changes_earlier_logits(positions):
    model = make_model(positions=positions, kv_heads=3)
    ids = prompt(b=2, n=11, seed=2)
    before = model(ids)
    for t in (0, 4, 10):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        after = model(changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-12)
        assert (after[:, t:] - before[:, t:]).abs().amax() > 1e-6  # the change does reach its own position on


@pytest.mark.parametrize("mlp", [None, 40])
def test_training_mode_backward_gives_finite_gradients_on_every_parameter(mlp):
    model = make_model(mlp=mlp, dropout=0.1, dtype=torch.float32, positions="learned").train()
    ids = prompt(b=3, n=9)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert bool(torch.isfinite(parameter.grad).all()), name
        assert parameter.grad.abs().sum() > 0, name
    names = {name for name, _ in model.named_parameters()}
    assert any(name.startswith("blocks.0.mlp_in") for name in names) == bool(mlp)


def test_a_few_adam_steps_reduce_the_loss_on_a_repeated_sequence():
    model = make_model(dtype=torch.float32, kv_heads=2, seed=4).train()
    torch.manual_seed(4)
    segment = torch.randint(0, VOCAB, (4, 6))
    batch = torch.cat([segment, segment, segment], dim=1)  # (4, 18): each row repeats its segment

    def loss() -> torch.Tensor:
        logits = model(batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        first = float(loss())
    for _ in range(40):
        optimizer.zero_grad()
        value = loss()
        value.backward()
        optimizer.step()
    with torch.no_grad():
        last = float(loss())
    assert last < 0.5 * first, (first, last)


# ------------------------------------------------------------------------------ saving and loading


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_give_identical_logits(tmp_path, tie):
    model = make_model(positions="learned", kv_heads=2, mlp=None, tie_embeddings=tie)
    model.name = "tiny"
    ids = prompt()
    folder = model.save(tmp_path / "model")
    loaded = load_decoder(folder)
    assert loaded.config == model.config and loaded.name == "tiny" and not loaded.training
    assert (loaded.lm_head is None) == tie
    assert torch.equal(loaded(ids), model(ids))
    assert torch.equal(loaded.generate(ids, 6), model.generate(ids, 6))
    assert load_decoder(folder, dtype=torch.float32).token_embeddings.weight.dtype == torch.float32


def test_load_refuses_broken_folders(tmp_path):
    model = make_model()
    folder = model.save(tmp_path / "model")
    with pytest.raises(FileNotFoundError, match="directory"):
        load_decoder(tmp_path / "absent")
    config = json.loads((folder / "multihead_decoder.json").read_text())
    config["decoder"]["heads"] = 5  # 24 % 5 != 0: a config the decoder refuses
    (folder / "multihead_decoder.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="multihead_decoder.json.*hidden") as error:
        load_decoder(folder)
    assert isinstance(error.value, InputError)
    config["decoder"]["heads"], config["decoder"]["layers"] = 6, 3  # weights for 2 layers only
    (folder / "multihead_decoder.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.safetensors.*missing"):
        load_decoder(folder)
    (folder / "multihead_decoder.json").write_text("{not json")
    with pytest.raises(ValueError, match="multihead_decoder.json"):
        load_decoder(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_decoder(folder)


# ------------------------------------------------------------------------------ refusals

BAD_CONFIGS = [
    ({"vocab_size": 0}, ValueError, "vocab_size"),
    ({"hidden": 25}, ValueError, "hidden"),
    ({"hidden": 36, "heads": 4}, ValueError, "hidden"),  # head size 9: rotary needs an even one
    ({"heads": 6, "kv_heads": 4}, ValueError, "kv_heads"),
    ({"kv_heads": 0}, ValueError, "kv_heads"),
    ({"layers": 2.0}, TypeError, "layers"),
    ({"mlp": -1}, ValueError, "mlp"),
    ({"mlp": 4.5}, TypeError, "mlp"),
    ({"positions": "sinusoidal"}, ValueError, "positions"),
    ({"dropout": 1.0}, ValueError, "dropout"),
    ({"layer_norm_eps": 0}, ValueError, "layer_norm_eps"),
    ({"tie_embeddings": 1}, TypeError, "tie_embeddings"),
]


@pytest.mark.parametrize(("fields", "kind", "name"), BAD_CONFIGS)
def test_bad_config_raises_naming_the_field(fields, kind, name):
    base = dict(vocab_size=VOCAB, hidden=24, heads=6)
    with pytest.raises(kind, match=rf"^{name}: expected") as error:
        DecoderConfig(**{**base, **fields})
    assert isinstance(error.value, InputError)


BAD_GENERATE = [
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens"),
    ({"temperature": -0.5}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"temperature": 1.0, "top_k": 0}, ValueError, "top_k"),
    ({"temperature": 1.0, "top_k": VOCAB + 1}, ValueError, "top_k"),
    ({"top_k": 3}, ValueError, "top_k"),  # greedy ignores top_k: refused, not silently dropped
    ({"seed": 1}, ValueError, "seed"),
    ({"temperature": 1.0, "seed": "1"}, TypeError, "seed"),
    ({"use_cache": 1}, TypeError, "use_cache"),
    ({"max_new_tokens": 15}, ValueError, "max_new_tokens"),  # 5 + 15 > 19 learned positions
    ({"prompt_ids": torch.zeros(1, 20, dtype=torch.long)}, ValueError, "prompt_ids"),
    ({"prompt_ids": [1, VOCAB]}, ValueError, "prompt_ids"),
    ({"prompt_ids": []}, TypeError, "prompt_ids"),
    ({"prompt_ids": torch.zeros(1, 3)}, TypeError, "prompt_ids"),
    ({"prompt_ids": torch.zeros(3, dtype=torch.long)}, TypeError, "prompt_ids"),
]


@pytest.mark.parametrize(("arguments", "kind", "name"), BAD_GENERATE)
def test_bad_generate_arguments_raise_naming_the_argument(arguments, kind, name):
    model = make_model(positions="learned")
    call = {"prompt_ids": prompt(b=1), "max_new_tokens": 3, **arguments}
    with pytest.raises(kind, match=rf"^{name}: expected"):
        model.generate(call.pop("prompt_ids"), call.pop("max_new_tokens"), **call)


def test_forward_refuses_bad_ids_and_too_long_learned_sequences():
    model = make_model(positions="learned")
    with pytest.raises(ValueError, match="^input_ids: expected.*max_positions"):
        model(prompt(b=1, n=20))
    with pytest.raises(ValueError, match="^input_ids: expected token ids"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="^max_len"):
        model.new_cache(1, 20)
    rotary = make_model()  # rotary positions have no table: longer sequences run
    assert rotary(prompt(b=1, n=20)).shape == (1, 20, VOCAB)
    assert rotary.generate([1, 2], 0).tolist() == [[1, 2]]
    for use_cache in (True, False):  # a length that can never fit is refused before allocating
        with pytest.raises(ValueError, match="^max_new_tokens: expected"):
            rotary.generate([1, 2], 10**15, use_cache=use_cache)


# ------------------------------------------------------------------------------ inspection


def test_capture_records_causal_weights_per_layer_and_head():
    model = make_model(kv_heads=2)
    ids = prompt(b=2, n=7)
    with capture(model, layers=[1], heads=[0, 4]) as recorder:
        logits = model(ids)
    torch.testing.assert_close(logits, model(ids), rtol=0, atol=0)  # recording changes nothing
    weights = recorder.weights(1, 4)  # (b, i, j)
    assert weights.shape == (2, 7, 7)
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # nothing above the diagonal
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 7, dtype=weights.dtype))
    assert not torch.allclose(weights, recorder.weights(1, 0))
    # the recorded weights are those of layer 1's attention on its own input (its LayerNorm of the stream)
    block = model.blocks[1]
    with torch.no_grad():
        stream = model.blocks[0](model.token_embeddings(ids))
        _, expected = block.attention(block.attention_norm(stream), causal=True, need_weights=True)
    torch.testing.assert_close(weights, expected[:, 4])
    with pytest.raises(ValueError, match="layer"):
        recorder.weights(0)


def test_capture_during_cached_generation_sees_every_step():
    model = make_model()
    with capture(model, layers=[0], heads=[2]) as recorder:
        model.generate(prompt(b=1, n=4), 3)
    assert recorder.calls(0) == 3  # the prompt, then one call per new token but the last
    assert recorder.weights(0, 2, call=0).shape == (1, 4, 4)
    last = recorder.weights(0, 2, call=-1)  # the 6th token's query over the 6 keys cached by then
    assert last.shape == (1, 1, 6)
    torch.testing.assert_close(last.sum(-1), torch.ones(1, 1, dtype=last.dtype))


def test_docstring_example_runs():
    import doctest

    from multihead.lab.models import decoder

    globs = {"torch": torch, "Decoder": Decoder, "DecoderConfig": DecoderConfig}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder().find(decoder, globs=globs)
    assert sum(len(test.examples) for test in tests) > 0
    for test in tests:
        runner.run(test)
    assert runner.failures == 0

"""multihead.lab.models.seq2seq: the encoder-decoder, its padding and causality contracts, cached generation,
saving, and capture of its three attention parts.

The reference for cached decoding is the same model recomputing the whole target prefix at every step
(``use_cache=False``); comparisons run in float64 so that they test the cache, not rounding. Sizes are
pairwise distinct: vocab 23, hidden 36, 6 heads, 2 encoder and 3 decoder layers, n_src 7, n_tgt 5, b 3.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead._errors import InputError
from multihead.lab.inspect import attention_sites, capture
from multihead.lab.models import SEQ2SEQ_CONFIG, DecoderCache, Seq2Seq, Seq2SeqConfig, load_seq2seq

VOCAB, HIDDEN, HEADS = 23, 36, 6
ENCODER_LAYERS, DECODER_LAYERS = 2, 3


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


def make_model(*, positions="rotary", kv_heads=None, mlp=17, seed=0, dtype=torch.float64, **overrides) -> Seq2Seq:
    """A 2+3-layer, 6-head seq2seq of width 36 (untied unless asked); embeddings and head scaled up so that
    the logits are far from uniform and the samples varied."""
    fields = dict(vocab_size=VOCAB, max_positions=13, hidden=HIDDEN, heads=HEADS, kv_heads=kv_heads, mlp=mlp)
    fields.update(encoder_layers=ENCODER_LAYERS, decoder_layers=DECODER_LAYERS)
    fields.update(positions=positions, tie_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Seq2Seq(Seq2SeqConfig(**fields)).to(dtype)
    with torch.no_grad():
        model.token_embeddings.weight.normal_(0.0, 1.0)
        if model.lm_head is not None:
            model.lm_head.weight.normal_(0.0, 0.3)
    return model.eval()


def ids(b=3, n=7, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def right_padded(lengths: list[int], n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, n) source ids with random junk after each row's length, and the (b, n) mask of real tokens."""
    source = ids(b=len(lengths), n=n, seed=seed)
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (b, n)
    return source, mask


VARIANTS = [
    pytest.param(positions, kv_heads, mlp, id=f"{positions}-{'gqa' if kv_heads else 'mha'}-{'mlp' if mlp else 'attn'}")
    for positions, kv_heads, mlp in (
        ("rotary", None, 17),
        ("rotary", 2, None),
        ("learned", 3, 17),
        ("learned", None, 0),
    )
]


# ------------------------------------------------------------------------------ shapes and structure


@pytest.mark.parametrize(("positions", "kv_heads", "mlp"), VARIANTS)
def test_shapes_and_attention_layers(positions, kv_heads, mlp):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    source, target = ids(b=3, n=7), ids(b=3, n=5, seed=2)
    memory = model.encode(source)
    assert memory.shape == (3, 7, HIDDEN)
    assert model.decode(target, memory).shape == (3, 5, VOCAB)
    torch.testing.assert_close(model(source, target), model.decode(target, memory), rtol=0, atol=0)
    out = model.generate(source, 4)
    assert out.shape == (3, 5) and out.dtype == torch.long and bool((out[:, 0] == 0).all())
    encoder, decoder, cross = model.encoder_layers, model.decoder_layers, model.cross_layers
    assert (len(encoder), len(decoder), len(cross)) == (ENCODER_LAYERS, DECODER_LAYERS, DECODER_LAYERS)
    assert model.attention_layers == encoder + decoder + cross
    assert all(layer.num_kv_heads == (kv_heads or HEADS) for layer in model.attention_layers)
    assert all((layer.rotary is not None) == (positions == "rotary") for layer in encoder + decoder)
    assert all(layer.rotary is None for layer in cross)  # target and source positions are unrelated
    names = {name for name, _ in model.named_parameters()}
    assert any(name.startswith("decoder_blocks.0.mlp_in") for name in names) == bool(mlp)
    assert ("source_positions.weight" in names) == (positions == "learned")


def test_tied_embeddings_share_one_matrix():
    model = make_model(tie_embeddings=True)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    seen = []
    model.final_norm.register_forward_hook(lambda module, args, out: seen.append(out))
    logits = model(ids(), ids(n=5, seed=2))
    torch.testing.assert_close(logits, seen[0] @ model.token_embeddings.weight.T)


# ------------------------------------------------------------------------------ padding and causality


@settings(max_examples=8, deadline=None)
@given(
    positions=st.sampled_from(["rotary", "learned"]),
    lengths=st.lists(st.integers(1, 7), min_size=2, max_size=3),
    as_int=st.booleans(),
)
def test_source_padding_never_changes_real_positions(positions, lengths, as_int):
    model = make_model(positions=positions, kv_heads=2)
    n = max(lengths) + 2  # every row has some padding
    source, mask = right_padded(lengths, n, seed=sum(lengths))
    target = ids(b=len(lengths), n=5, seed=4)
    flags = mask.long() if as_int else mask
    memory = model.encode(source, flags)
    logits = model(source, target, flags)
    for row, length in enumerate(lengths):
        alone = source[row : row + 1, :length]  # (1, length): the unpadded sequence
        torch.testing.assert_close(memory[row, :length], model.encode(alone)[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(logits[row], model(alone, target[row : row + 1])[0], rtol=1e-10, atol=1e-10)
    # not vacuous: without the mask the padding does change the outputs
    assert (model(source, target) - logits).abs().amax() > 1e-6


def test_source_padding_never_changes_generation():
    model = make_model(kv_heads=3)
    source, mask = right_padded([7, 3, 5], 9)
    out = model.generate(source, 6, source_mask=mask)
    for row, length in enumerate([7, 3, 5]):
        assert torch.equal(out[row], model.generate(source[row : row + 1, :length], 6)[0])


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_a_later_decoder_input_never_changes_earlier_logits(positions):
    model = make_model(positions=positions, kv_heads=3)
    source, target = ids(b=2, n=7), ids(b=2, n=11, seed=2)
    before = model(source, target)
    for t in (0, 4, 10):
        changed = target.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        after = model(source, changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-12)
        assert (after[:, t:] - before[:, t:]).abs().amax() > 1e-6  # the change does reach its own position on
    # every target position reads the source: changing the last source token changes the first logits
    changed = source.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    assert (model(changed, target)[:, 0] - before[:, 0]).abs().amax() > 1e-6


# ------------------------------------------------------------------------------ the KV cache


@pytest.mark.parametrize(("positions", "kv_heads", "mlp"), VARIANTS)
def test_cached_generation_equals_uncached(positions, kv_heads, mlp):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    source, mask = right_padded([7, 2, 5], 7)
    call = dict(source_mask=mask, start_id=3)
    greedy = model.generate(source, 11, **call, use_cache=True)
    assert torch.equal(greedy, model.generate(source, 11, **call, use_cache=False))
    assert greedy.shape == (3, 12) and bool((greedy[:, 0] == 3).all())
    sampled = model.generate(source, 11, **call, temperature=1.3, seed=7, use_cache=True)
    assert torch.equal(sampled, model.generate(source, 11, **call, temperature=1.3, seed=7, use_cache=False))
    top_k = model.generate(source, 11, **call, temperature=0.9, top_k=4, seed=3, use_cache=True)
    assert torch.equal(top_k, model.generate(source, 11, **call, temperature=0.9, top_k=4, seed=3, use_cache=False))
    # not vacuous: the new tokens vary, and sampling differs from greedy
    assert len(set(greedy[:, 1:].flatten().tolist())) > 2
    assert not torch.equal(sampled, greedy)


def test_greedy_picks_the_argmax_and_a_seed_reproduces_sampling():
    model = make_model(kv_heads=2)
    source = ids(b=2, n=5)
    greedy = model.generate(source, 4)
    for step in range(4):
        assert torch.equal(greedy[:, 1 + step], model(source, greedy[:, : 1 + step])[:, -1].argmax(-1))
    first = model.generate(source, 9, temperature=1.0, seed=11)
    assert torch.equal(first, model.generate(source, 9, temperature=1.0, seed=11))
    assert not torch.equal(first, model.generate(source, 9, temperature=1.0, seed=12))
    assert model.generate(source, 0).tolist() == [[0], [0]]


@pytest.mark.parametrize(("positions", "kv_heads", "mlp"), VARIANTS[::3])
def test_cached_decode_in_chunks_equals_the_full_decode(positions, kv_heads, mlp):
    model = make_model(positions=positions, kv_heads=kv_heads, mlp=mlp)
    source, mask = right_padded([7, 4], 7)
    target = ids(b=2, n=11, seed=5)
    memory = model.encode(source, mask)
    full = model.decode(target, memory, mask)  # (b, n_tgt, vocab)
    cache = model.new_cache(2, 13)
    chunks = []
    for start, end in ((0, 3), (3, 4), (4, 8), (8, 11)):
        chunks.append(model.decode(target[:, start:end], memory, mask, cache))
        assert cache.seen == end
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-10, atol=1e-10)


def test_a_refused_cached_decode_leaves_the_cache_as_it_was():
    model = make_model()
    memory = model.encode(ids(b=2))
    cache = model.new_cache(2, 6)
    model.decode(ids(b=2, n=4), memory, cache=cache)
    with pytest.raises(ValueError, match="cache"):
        model.decode(ids(b=2, n=3), memory, cache=cache)  # 4 + 3 > 6
    assert cache.seen == 4 and all(len(layer) == 4 for layer in cache.layers)
    with pytest.raises(ValueError, match="^memory: expected shape"):
        model.decode(ids(b=2, n=1), memory[:1], cache=cache)
    with pytest.raises(TypeError, match="^cache: expected"):
        model.decode(ids(b=2, n=1), memory, cache=cache.layers)
    assert cache.seen == 4 and isinstance(cache, DecoderCache) and len(cache.layers) == DECODER_LAYERS


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize(("positions", "mlp"), [("learned", None), ("rotary", 17)])
def test_training_mode_backward_gives_finite_gradients_on_every_parameter(positions, mlp):
    model = make_model(positions=positions, mlp=mlp, kv_heads=2, dropout=0.1, dtype=torch.float32).train()
    source, mask = right_padded([7, 5, 6], 7)
    target = ids(b=3, n=6, seed=2)
    logits = model(source, target[:, :-1], mask)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target[:, 1:].reshape(-1))
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert bool(torch.isfinite(parameter.grad).all()), name
        assert parameter.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------ saving and loading


@pytest.mark.parametrize(("tie", "positions"), [(True, "learned"), (False, "rotary")])
def test_save_and_load_give_identical_logits(tmp_path, tie, positions):
    model = make_model(positions=positions, kv_heads=2, mlp=None, tie_embeddings=tie)
    model.name = "tiny"
    source, target = ids(), ids(n=5, seed=2)
    folder = model.save(tmp_path / "model")
    assert sorted(path.name for path in folder.iterdir()) == ["model.safetensors", SEQ2SEQ_CONFIG]
    loaded = load_seq2seq(folder)
    assert loaded.config == model.config and loaded.name == "tiny" and not loaded.training
    assert (loaded.lm_head is None) == tie
    assert torch.equal(loaded(source, target), model(source, target))
    assert torch.equal(loaded.generate(source, 6), model.generate(source, 6))
    assert load_seq2seq(folder, dtype=torch.float32).token_embeddings.weight.dtype == torch.float32


def test_load_refuses_damaged_folders_naming_the_file(tmp_path):
    model = make_model()
    folder = model.save(tmp_path / "model")
    config_file = folder / SEQ2SEQ_CONFIG
    saved = json.loads(config_file.read_text())
    with pytest.raises(FileNotFoundError, match="^directory"):
        load_seq2seq(tmp_path / "absent")
    saved["seq2seq"]["heads"] = 7  # 36 % 7 != 0: a config the model refuses
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"^{SEQ2SEQ_CONFIG}: expected.*hidden") as error:
        load_seq2seq(folder)
    assert isinstance(error.value, InputError)
    saved["seq2seq"]["heads"], saved["seq2seq"]["encoder_layers"] = HEADS, "2"  # a field of the wrong type
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"^{SEQ2SEQ_CONFIG}: expected.*encoder_layers"):
        load_seq2seq(folder)
    saved["seq2seq"]["encoder_layers"] = 3  # weights for 2 encoder layers only
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="^model.safetensors: expected.*missing"):
        load_seq2seq(folder)
    saved["seq2seq"]["encoder_layers"], saved["seq2seq"]["mlp"] = ENCODER_LAYERS, 19  # MLP widths 17 saved
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="^model.safetensors: expected.*mlp_in.*shape"):
        load_seq2seq(folder)
    saved["format"] = "multihead-decoder"
    config_file.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"^{SEQ2SEQ_CONFIG}: expected.*format"):
        load_seq2seq(folder)
    config_file.write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{SEQ2SEQ_CONFIG}: expected"):
        load_seq2seq(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    config_file.write_text(
        json.dumps({**saved, "format": "multihead-seq2seq", "seq2seq": dataclasses.asdict(model.config)})
    )
    with pytest.raises(ValueError, match="^model.safetensors: expected a safetensors file"):
        load_seq2seq(folder)
    config_file.unlink()
    with pytest.raises(ValueError, match=f"^directory: expected.*without {SEQ2SEQ_CONFIG}"):
        load_seq2seq(folder)


# ------------------------------------------------------------------------------ refusals

BAD_CONFIGS = [
    ({"vocab_size": 0}, ValueError, "vocab_size"),
    ({"max_positions": -3}, ValueError, "max_positions"),
    ({"hidden": 37}, ValueError, "hidden"),
    ({"hidden": 30}, ValueError, "hidden"),  # head size 5: rotary needs an even one
    ({"encoder_layers": 0}, ValueError, "encoder_layers"),
    ({"decoder_layers": 2.0}, TypeError, "decoder_layers"),
    ({"heads": 0}, ValueError, "heads"),
    ({"kv_heads": 4}, ValueError, "kv_heads"),
    ({"kv_heads": 0}, ValueError, "kv_heads"),
    ({"mlp": -1}, ValueError, "mlp"),
    ({"mlp": 4.5}, TypeError, "mlp"),
    ({"positions": "sinusoidal"}, ValueError, "positions"),
    ({"dropout": 1.0}, ValueError, "dropout"),
    ({"layer_norm_eps": 0}, ValueError, "layer_norm_eps"),
    ({"tie_embeddings": 1}, TypeError, "tie_embeddings"),
]


@pytest.mark.parametrize(("fields", "kind", "name"), BAD_CONFIGS)
def test_bad_config_raises_naming_the_field(fields, kind, name):
    base = dict(vocab_size=VOCAB, hidden=HIDDEN, heads=HEADS)
    with pytest.raises(kind, match=rf"^{name}: expected") as error:
        Seq2SeqConfig(**{**base, **fields})
    assert isinstance(error.value, InputError)


BAD_CALLS = [
    ("encode", {"source_ids": torch.zeros(3, 7)}, TypeError, "source_ids: expected an integer tensor"),
    ("encode", {"source_ids": torch.full((3, 7), VOCAB)}, ValueError, "source_ids: expected token ids"),
    ("encode", {"source_ids": torch.zeros(3, 14, dtype=torch.long)}, ValueError, "source_ids: expected at most"),
    ("encode", {"source_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, r"source_mask: expected shape"),
    ("encode", {"source_mask": torch.ones(3, 7)}, TypeError, "source_mask: expected a bool"),
    ("encode", {"source_mask": torch.full((3, 7), 2)}, ValueError, "source_mask: expected 0"),
    ("encode", {"source_mask": torch.zeros(3, 7, dtype=torch.bool)}, ValueError, "source_mask: expected at least"),
    ("forward", {"decoder_input_ids": torch.zeros(2, 5, dtype=torch.long)}, ValueError, "decoder_input_ids: .*batch"),
    ("forward", {"decoder_input_ids": torch.zeros(3, 14, dtype=torch.long)}, ValueError, "decoder_input_ids: exp"),
    ("generate", {"max_new_tokens": 13}, ValueError, "max_new_tokens: expected 1 \\+ new"),  # 1 + 13 > 13
    ("generate", {"max_new_tokens": -1}, ValueError, "max_new_tokens: expected"),
    ("generate", {"start_id": VOCAB}, ValueError, "start_id: expected"),
    ("generate", {"start_id": "0"}, TypeError, "start_id: expected"),
    ("generate", {"top_k": 3}, ValueError, "top_k: expected"),  # greedy ignores top_k: refused, not dropped
    ("generate", {"temperature": -1.0}, ValueError, "temperature: expected"),
    ("generate", {"use_cache": 1}, TypeError, "use_cache: expected"),
]


@pytest.mark.parametrize(("method", "arguments", "kind", "message"), BAD_CALLS)
def test_bad_arguments_raise_naming_the_argument(method, arguments, kind, message):
    model = make_model(positions="learned")
    arguments = dict(arguments)
    source = arguments.pop("source_ids", ids(b=3, n=7))
    with pytest.raises(kind, match=f"^{message}") as error:
        if method == "encode":
            model.encode(source, arguments.get("source_mask"))
        elif method == "forward":
            model(source, arguments["decoder_input_ids"])
        else:
            model.generate(source, arguments.pop("max_new_tokens", 3), **arguments)
    assert isinstance(error.value, InputError)


def test_decode_refuses_memory_that_is_not_the_encoders():
    model = make_model()
    target = ids(b=3, n=5)
    with pytest.raises(TypeError, match="^memory: expected a floating tensor"):
        model.decode(target, ids(b=3, n=7))
    with pytest.raises(ValueError, match="^memory: expected shape"):
        model.decode(target, torch.zeros(3, 7, HIDDEN + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^source_mask: expected shape .*\(from memory\)"):
        model.decode(target, torch.zeros(3, 7, HIDDEN, dtype=torch.float64), torch.ones(3, 6, dtype=torch.bool))


# ------------------------------------------------------------------------------ inspection


def test_attention_sites_come_in_three_parts_numbered_from_zero():
    model = make_model(kv_heads=3)
    sites = attention_sites(model)
    assert [(site.part, site.index) for site in sites] == (
        [("encoder", index) for index in range(ENCODER_LAYERS)]
        + [("decoder", index) for index in range(DECODER_LAYERS)]
        + [("cross", index) for index in range(DECODER_LAYERS)]
    )
    assert [site.attend for site in sites] == [layer.attend for layer in model.attention_layers]
    assert all((site.num_heads, site.num_kv_heads) == (HEADS, 3) for site in sites)
    modules = dict(model.named_modules())
    assert all(modules[site.name].attend is site.attend for site in sites)
    with pytest.raises(ValueError, match="part"):
        capture(model, part="self")


def test_capture_cross_weights_cover_the_real_source_keys():
    model = make_model(kv_heads=2)
    source, mask = right_padded([7, 3, 5], 7)
    target = ids(b=3, n=5, seed=2)
    with capture(model, part="cross", layers=[0, 2]) as recorder:
        logits = model(source, target, mask)
    torch.testing.assert_close(logits, model(source, target, mask), rtol=0, atol=0)  # recording changes nothing
    weights = recorder.weights(2)  # (b, h, n_tgt, n_src)
    assert weights.shape == (3, HEADS, 5, 7)
    real = mask[:, None, None, :].expand_as(weights)
    assert torch.equal(weights[~real], torch.zeros_like(weights[~real]))  # padded source keys get nothing
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, HEADS, 5, dtype=weights.dtype))
    assert not torch.allclose(recorder.weights(0), weights)
    # the recorded weights are those of cross layer 2 on its own inputs
    block = model.decoder_blocks[2]
    with torch.no_grad():
        memory = model.encode(source, mask)
        keys = mask[:, None, None, :]  # (b, 1, 1, n_src): True = a real source key
        stream = model.token_embeddings(target)
        for earlier in model.decoder_blocks[:2]:
            stream = earlier(stream, memory, keys)
        attended, _ = block.attention(block.attention_norm(stream), causal=True)
        stream = stream + attended
        _, expected = block.cross_attention(block.cross_norm(stream), memory, mask=keys, need_weights=True)
    torch.testing.assert_close(weights, expected)


def test_capture_decoder_weights_are_causal_and_encoder_weights_square():
    model = make_model()
    source, target = ids(b=2, n=7), ids(b=2, n=5, seed=2)
    with capture(model, part="decoder", layers=[1], heads=[0, 4]) as decoder:
        model(source, target)
    weights = decoder.weights(1)  # (b, 2, n_tgt, n_tgt)
    assert weights.shape == (2, 2, 5, 5)
    assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # nothing above the diagonal
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5, dtype=weights.dtype))
    with capture(model, part="encoder") as encoder:
        model.encode(source)
    assert encoder.weights(1).shape == (2, HEADS, 7, 7)
    assert bool((encoder.weights(1).triu(1) > 0).any())  # bidirectional


def test_capture_during_cached_generation_sees_every_step():
    model = make_model()
    with capture(model, part="cross", layers=[1], heads=[2]) as recorder:
        model.generate(ids(b=1, n=7), 3)
    assert recorder.calls(1) == 3  # the start token, then one call per new token but the last
    assert all(recorder.weights(1, 2, call=call).shape == (1, 1, 7) for call in range(3))


def test_ablating_a_cross_head_changes_the_logits_and_restoring_undoes_it():
    model = make_model()
    source, target = ids(), ids(n=5, seed=2)
    before = model(source, target)
    model.cross_layers[1].ablate_heads([0, 3])
    ablated = model(source, target)
    assert (ablated - before).abs().amax() > 1e-6
    model.cross_layers[1].restore_heads()
    torch.testing.assert_close(model(source, target), before, rtol=0, atol=0)


def test_docstring_example_runs():
    import doctest

    from multihead.lab.models import seq2seq

    globs = {"torch": torch, "Seq2Seq": Seq2Seq, "Seq2SeqConfig": Seq2SeqConfig}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder().find(seq2seq, globs=globs)
    assert sum(len(test.examples) for test in tests) > 0
    for test in tests:
        runner.run(test)
    assert runner.failures == 0

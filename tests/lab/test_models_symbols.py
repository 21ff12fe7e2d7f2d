"""multihead.lab.models.symbols: the symbol tokenizer of synthetic tasks, the decoder as a text reader, the checkpoint
door (load_text_model) and the behaviour probes folded into roles."""

from __future__ import annotations

import json

import pytest
import torch

from multihead._errors import InputError
from multihead.integrations import load_text_model
from multihead.lab.inspect import capture, inspect_text
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE, read_behaviours, read_task, write_behaviours
from multihead.lab.inspect.roles import ROLE_RULES, label_head
from multihead.lab.models import Decoder, DecoderConfig
from multihead.lab.models.symbols import (
    BOS_SYMBOL,
    SYMBOLS_FILE,
    DecoderReader,
    SymbolTokenizer,
    load_decoder_reader,
    task_symbols,
)
from multihead.lab.models.tasks import example_text
from multihead.lab.train.induction import InductionSettings


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


def small_decoder(vocab: int = 7, **options) -> Decoder:
    torch.manual_seed(0)
    config = {"vocab_size": vocab, "max_positions": 11, "hidden": 12, "layers": 2, "heads": 3, "mlp": None, **options}
    return Decoder(DecoderConfig(**config), name="tiny").eval()


def test_task_symbols_are_letters_then_numbered():
    assert task_symbols(4) == [BOS_SYMBOL, "a", "b", "c"]
    assert task_symbols(27)[-1] == "z"
    many = task_symbols(30)
    assert many[1] == "t1" and many[-1] == "t29" and len(set(many)) == 30
    for bad, error in ((1, ValueError), (2.0, ValueError), (True, ValueError)):
        with pytest.raises(error, match="vocab_size"):
            task_symbols(bad)


def test_tokenizer_puts_bos_first_pads_right_and_maps_ids():
    tokenizer = SymbolTokenizer(task_symbols(7), max_length=9)
    batch = tokenizer.batch(["a b c", "<bos> f e", ["d"]])
    assert batch.tokens == [["<bos>", "a", "b", "c"], ["<bos>", "f", "e"], ["<bos>", "d"]]
    assert batch.input_ids.tolist() == [[0, 1, 2, 3], [0, 6, 5, 0], [0, 4, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch.word_ids[0] == [None, 0, 1, 2] and batch.pieces[0].words == ["a", "b", "c"]  # a word each
    assert tokenizer.text([0, 3, 2]) == "<bos> c b"
    assert tokenizer.tokenize("  a\tb\n") == ["<bos>", "a", "b"]


def test_tokenizer_refusals():
    tokenizer = SymbolTokenizer(task_symbols(7), max_length=4)
    with pytest.raises(InputError, match="text: .*symbols of the model's vocabulary.*'bank'"):
        tokenizer.batch(["a bank"])
    with pytest.raises(InputError, match=r"texts\[1\]: .*'Z'"):
        tokenizer.batch(["a", "Z"])
    with pytest.raises(InputError, match="at most 4 tokens"):
        tokenizer.batch(["a b c d"])
    assert tokenizer.batch(["a b c d e"], truncate=True).tokens == [["<bos>", "a", "b", "c"]]
    for symbols, error in ((["a", "a"], ValueError), (["a b"], TypeError), ([], TypeError), ([3], TypeError)):
        with pytest.raises(error, match="symbols"):
            SymbolTokenizer(symbols, max_length=4)


def test_reader_states_are_the_decoders_and_padding_must_be_right():
    decoder = small_decoder()
    reader = DecoderReader(decoder, tokenizer=SymbolTokenizer(task_symbols(7), max_length=11))
    batch = reader.tokenizer.batch(["a b c d", "e f"])
    with torch.no_grad():
        states = reader(batch.input_ids, batch.attention_mask)
        alone = decoder.hidden_states(batch.input_ids[1:, :3])
    assert states.shape == (2, 5, 12)
    assert torch.allclose(states[1, :3], alone[0], atol=1e-6)  # right padding never reaches a real token
    logits = decoder(batch.input_ids)
    assert torch.allclose(logits, states @ decoder.token_embeddings.weight.T, atol=1e-5)
    left = torch.tensor([[0, 1, 1]])
    with pytest.raises(InputError, match="attention_mask: .*padding on the right"):
        reader(torch.tensor([[1, 2, 3]]), left)
    with pytest.raises(TypeError, match="decoder"):
        DecoderReader(torch.nn.Linear(2, 2))
    assert reader.attention_layers == decoder.attention_layers and reader.is_causal


def test_load_text_model_opens_a_saved_decoder_with_its_symbols(tmp_path):
    decoder = small_decoder(kv_heads=1)
    decoder.save(tmp_path)
    reader = load_text_model(tmp_path)
    assert isinstance(reader, DecoderReader) and reader.tokenizer is None  # no symbols.json: ids only
    SymbolTokenizer(task_symbols(7), max_length=1).save(tmp_path)
    reader = load_text_model(tmp_path)
    assert reader.tokenizer.symbols == task_symbols(7) and reader.tokenizer.max_length == 11
    ids = torch.tensor([[0, 3, 1, 2]])
    with torch.no_grad():
        assert torch.equal(reader.decoder(ids), decoder(ids))
    with capture(reader) as recorder, torch.no_grad():
        reader(ids)
    assert recorder.weights(1).shape == (1, 3, 4, 4)
    (tmp_path / SYMBOLS_FILE).write_text(json.dumps({"symbols": ["<bos>", "a"]}))
    with pytest.raises(InputError, match="symbols.json: .*7 symbols"):
        load_decoder_reader(tmp_path)
    (tmp_path / SYMBOLS_FILE).write_text(json.dumps({"symbols": "abc"}))
    with pytest.raises(InputError, match="symbols.json"):
        load_decoder_reader(tmp_path)


def test_inspect_a_decoder_reader_shows_causal_weights():
    reader = DecoderReader(small_decoder(), tokenizer=SymbolTokenizer(task_symbols(7), max_length=11))
    inspection = inspect_text(reader, "a b c a b c")
    assert inspection.causal and inspection.tokens == ["<bos>", "a", "b", "c", "a", "b", "c"]
    assert inspection.weights.shape == (2, 3, 7, 7)
    assert torch.all(inspection.weights.triu(1) == 0)
    assert inspection.role_stats.behaviours is None


def behaviour_grid(prefix, copying):
    return {
        "prefix_matching": torch.tensor(prefix, dtype=torch.float64),
        "copying": torch.tensor(copying, dtype=torch.float64),
    }


def test_behaviours_fold_into_roles_and_copying_decides_induction():
    reader = DecoderReader(small_decoder(), tokenizer=SymbolTokenizer(task_symbols(7), max_length=11))
    measures = behaviour_grid([[0.0, 0.1, 0.0], [0.9, 0.6, 0.05]], [[0.0, 0.0, 0.0], [0.8, 0.1, 0.0]])
    inspection = inspect_text(reader, "a b c a b c", behaviours=measures)
    roles = inspection.role_stats.roles()
    assert roles[1][0].label == "induction" and roles[1][0].strength == pytest.approx(0.9)
    assert roles[1][1].label == "prefix"  # matches prefixes, but its own logits do not copy
    assert "induction" not in {role.label for role in roles[0]}
    assert "rank the next token first at 80%" in roles[1][0].summary
    assert "behaviour probes" in inspection.role_stats.roles_source
    only_layer_one = inspect_text(reader, "a b c a b c", layers=[1], heads=[0, 2], behaviours=measures)
    assert [role.label for role in only_layer_one.role_stats.roles()[0]][0] == "induction"
    assert only_layer_one.role_stats.behaviours["prefix_matching"].tolist() == [[0.9, 0.05]]
    with pytest.raises(InputError, match="behaviours"):
        inspect_text(reader, "a b", behaviours={"prefix_matching": torch.zeros(1, 3)})
    with pytest.raises(InputError, match="behaviours"):
        inspect_text(reader, "a b", behaviours={"speed": torch.zeros(2, 3)})


def test_label_head_alignment_and_thresholds():
    stat = {"best_offset": -1.0}
    aligned = label_head({**stat, "alignment": 0.95}, {"probe": 1.0})
    assert aligned.label == "aligned" and aligned.confidence == "high"
    weak = label_head({**stat, "alignment": 0.2}, {"probe": 1.0})
    assert weak.confidence == "low"
    rule = ROLE_RULES["induction"]
    at = label_head({**stat, "prefix_matching": rule.threshold, "copying": ROLE_RULES["copying"].threshold}, {"p": 1})
    assert at.label == "induction" and at.signals[0].evidence == pytest.approx(1.0)
    nan = label_head({**stat, "prefix_matching": float("nan"), "alignment": 0.7}, {"p": 1})
    assert nan.label == "aligned"


def test_behaviours_file_round_trip_and_task(tmp_path):
    measures = behaviour_grid([[0.5, float("nan")]], [[0.1, 0.2]])
    settings = InductionSettings(layers=1, heads=2, hidden=8, steps=1)
    write_behaviours(tmp_path, measures, task="induction", part="self", settings=settings)
    saved = read_behaviours(tmp_path)
    assert set(saved) == {"self"}
    assert saved["self"]["prefix_matching"][0, 0] == 0.5 and saved["self"]["prefix_matching"][0, 1].isnan()
    task, saved_settings = read_task(tmp_path)
    assert task == "induction" and saved_settings["heads"] == 2
    assert read_behaviours(tmp_path / "elsewhere") is None and read_task(tmp_path / "elsewhere") is None
    data = json.loads((tmp_path / BEHAVIOURS_FILE).read_text())
    del data["part"]
    (tmp_path / BEHAVIOURS_FILE).write_text(json.dumps(data))
    with pytest.raises(InputError, match="behaviours.json"):
        read_task(tmp_path)


def test_example_text_is_an_input_of_the_task():
    text = example_text("induction", {"half_length": 5, "vocab_size": 9})
    symbols = text.split()
    assert symbols[0] == BOS_SYMBOL and symbols[1:6] == symbols[6:11] and len(symbols) == 11
    source = example_text("reverse", {"length": 7, "vocab_size": 9}).split()
    assert len(source) == 7 and BOS_SYMBOL not in source
    assert example_text("reverse", {"length": 7, "vocab_size": 9}, seed=1) != " ".join(source)
    with pytest.raises(InputError, match="task"):
        example_text("sort", {"length": 3, "vocab_size": 9})

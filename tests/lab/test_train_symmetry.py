"""multihead.lab.train.symmetry: heads that start identical stay identical (bit for bit), random ones diverge."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.lab.models.decoder import Decoder, DecoderConfig
from multihead.lab.train import (
    InductionSettings,
    SymmetryRun,
    head_parameter_difference,
    heads_divergence,
    induction_batch,
    make_heads_identical,
    per_position_loss,
    run_symmetry,
    symmetry_experiment,
    train,
)
from multihead.lab.train.symmetry import _head_blocks


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine (and the exactness findings are 1-thread)."""


def decoder(hidden: int = 64, *, dtype: torch.dtype = torch.float32, kv_heads: int | None = None, seed: int = 0):
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=23, hidden=hidden, layers=2, heads=4, kv_heads=kv_heads, mlp=None)
    return Decoder(config).to(dtype)


def train_briefly(model: Decoder, steps: int = 20) -> None:
    def make_batch(generator):
        return induction_batch(5, 7, 23, generator=generator, min_half_length=3)

    def loss_fn(model, task):
        return per_position_loss(model(task.ids), task.ids).mean()

    train(model, make_batch, steps=steps, lr=1e-2, seed=3, loss_fn=loss_fn, log_every=steps)


def ids(seed: int = 1) -> torch.Tensor:
    return induction_batch(3, 7, 23, generator=torch.Generator().manual_seed(seed)).ids  # (3, 15)


def assert_heads_equal(layer: MultiHeadAttention, source_head: int = 0) -> None:
    for name, heads, source in _head_blocks(layer, source_head):
        for head in range(heads.shape[0]):
            assert torch.equal(heads[head], heads[source]), f"{name}: head {head} differs from head {source}"


# --- exact symmetry ------------------------------------------------------------------------------------------------


# Bitwise identity needs every kernel to round each head's slice alike. Sizes where torch 2.13's CPU kernels do
# (see the module docstring): float32 at h*e = 64 (the experiment's default) and 96, float64 at h*e = 96. Not
# float64 at h*e = 64: MKL's float64 GEMM rounds the last 64 mod 12 = 4 columns (head 3's) differently.
@pytest.mark.parametrize(
    "dtype, hidden, kv_heads",
    [(torch.float32, 64, None), (torch.float32, 96, None), (torch.float64, 96, None), (torch.float32, 64, 2)],
    ids=["float32-h64", "float32-h96", "float64-h96", "float32-gqa"],
)
def test_identical_heads_stay_bitwise_identical_through_training(dtype, hidden, kv_heads):
    model = decoder(hidden, dtype=dtype, kv_heads=kv_heads)
    for layer in model.attention_layers:
        make_heads_identical(layer)
    before = [layer.q_proj.weight.detach().clone() for layer in model.attention_layers]
    train_briefly(model, steps=20)
    for layer, old in zip(model.attention_layers, before, strict=True):
        assert not torch.equal(layer.q_proj.weight, old)  # it did train
        assert_heads_equal(layer)
        assert head_parameter_difference(layer) == 0.0
        # identical parameters, identical attention: the divergence is exactly 0
        divergence = heads_divergence(model, ids(), model.attention_layers.index(layer))
        assert torch.equal(divergence, torch.zeros(4, 4, dtype=torch.float64))


def test_float64_at_h_e_64_differs_at_most_by_rounding():
    """Here MKL's float64 GEMM rounds head 3's last 4 of the 64 W^O columns differently (machine-dependent, so
    only the bound is pinned): the heads may drift apart, but by rounding, not learning."""
    model = decoder(64, dtype=torch.float64)
    for layer in model.attention_layers:
        make_heads_identical(layer)
    train_briefly(model, steps=20)
    for index, layer in enumerate(model.attention_layers):
        assert head_parameter_difference(layer) < 1e-12
        assert float(heads_divergence(model, ids(), index).max()) < 1e-12


def test_residual_dropout_keeps_the_symmetry():
    """Dropout after W^O masks features of the heads' sum: every head sees the same mask, so they stay identical."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=23, hidden=64, layers=2, heads=4, mlp=None, dropout=0.2))
    for layer in model.attention_layers:
        make_heads_identical(layer)
        layer.dropout = 0.0  # the attention weights' dropout off; the residual and embedding dropout stay on
    train_briefly(model, steps=10)
    for layer in model.attention_layers:
        assert_heads_equal(layer)


def test_identical_heads_attend_identically_row_for_row():
    model = decoder()
    make_heads_identical(model.attention_layers[1], source_head=2)
    train_briefly(model, steps=5)
    layer = model.attention_layers[1]
    x = torch.randn(2, 9, 64)
    _, weights = layer(x, causal=True, need_weights=True)  # (b, h, i, j)
    for head in range(4):
        assert torch.equal(weights[:, head], weights[:, 2])


def test_attention_dropout_breaks_the_symmetry():
    """Dropout on the attention weights draws a different mask for each head: the gradients differ at once."""
    model = decoder()
    for layer in model.attention_layers:
        make_heads_identical(layer)
        layer.dropout = 0.2  # the attention weights' dropout only (the residual dropout is symmetric in the heads)
    train_briefly(model, steps=20)
    for index, layer in enumerate(model.attention_layers):
        assert head_parameter_difference(layer) > 1e-4  # learning, not rounding (float32 rounding is ~1e-9 here)
        assert float(heads_divergence(model, ids(), index).max()) > 1e-6


# --- the experiment ------------------------------------------------------------------------------------------------


def test_symmetry_experiment_random_heads_diverge_identical_ones_do_not():
    result = symmetry_experiment(steps=60, log_every=30, half_length=6, min_half_length=3, batch=8, seed=1)
    json.dumps(result)  # JSON-ready
    random_history, identical_history = result["random"]["history"], result["identical"]["history"]
    assert [entry["step"] for entry in random_history] == [0, 30, 60]
    assert [entry["step"] for entry in identical_history] == [0, 30, 60]
    assert result["identical_stayed_identical"] is True
    for entry in identical_history:
        assert entry["divergence_mean"] == [0.0, 0.0]
        assert entry["divergence_min"] == [0.0, 0.0]
        assert entry["head_difference"] == [0.0, 0.0]
        assert all(len(set(scores)) == 1 for scores in entry["induction"])  # one score, h times over
    last = random_history[-1]
    assert min(last["divergence_mean"]) > 0.1  # bits: clearly different patterns
    assert min(last["divergence_min"]) > 0.005
    assert "head_difference" not in last
    # the same batches and initialisation otherwise: the first logs' losses are those of two different models
    assert random_history[1]["loss"] != identical_history[1]["loss"]


def test_symmetry_experiment_identical_layers_choose_which_layers():
    result = symmetry_experiment(steps=4, log_every=4, identical_layers=[1], half_length=4, min_half_length=2, batch=3)
    first = result["identical"]["history"][0]
    assert result["identical_layers"] == [1]
    assert first["divergence_mean"][0] > 0.01 and first["divergence_mean"][1] == 0.0
    assert len(first["head_difference"]) == 1


@pytest.mark.parametrize(
    "kwargs, kind, fragment",
    [
        ({"identical_layers": [2]}, ValueError, "identical_layers"),
        ({"identical_layers": ["0"]}, TypeError, "identical_layers"),
        ({"config": DecoderConfig(vocab_size=32, mlp=None), "vocab_size": 99}, ValueError, "config.vocab_size = 32"),
        ({"config": "small"}, TypeError, "config"),
        ({"half_length": 1}, ValueError, "half_length"),
        ({"min_half_length": 9}, ValueError, "min_half_length"),
        ({"dtype": torch.int64}, ValueError, "dtype"),
        ({"dtype": "float32"}, TypeError, "dtype"),
        ({"seed": 1.5}, TypeError, "seed"),
    ],
)
def test_symmetry_experiment_rejects_bad_settings(kwargs, kind, fragment):
    with pytest.raises(kind, match=fragment):
        symmetry_experiment(steps=1, **kwargs)


# --- make_heads_identical ------------------------------------------------------------------------------------------


def test_make_heads_identical_copies_the_source_head_gqa():
    """h = 6 query heads over g = 3 key/value heads (2 per group), d = 4, e = 5, cross-attention sizes: query
    head 3 reads key/value head 1, which every key/value head becomes."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(14, 6, num_kv_heads=3, head_dim=4, value_head_dim=5, kdim=7, vdim=11, out_dim=13)
    for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
        torch.nn.init.normal_(proj.bias)
    old = {name: p.detach().clone() for name, p in layer.named_parameters()}
    make_heads_identical(layer, source_head=3)
    assert torch.equal(layer.q_proj.weight, old["q_proj.weight"][12:16].repeat(6, 1))  # rows 3d..4d-1
    assert torch.equal(layer.q_proj.bias, old["q_proj.bias"][12:16].repeat(6))
    assert torch.equal(layer.k_proj.weight, old["k_proj.weight"][4:8].repeat(3, 1))  # kv head 1: rows d..2d-1
    assert torch.equal(layer.k_proj.bias, old["k_proj.bias"][4:8].repeat(3))
    assert torch.equal(layer.v_proj.weight, old["v_proj.weight"][5:10].repeat(3, 1))  # rows e..2e-1
    assert torch.equal(layer.v_proj.bias, old["v_proj.bias"][5:10].repeat(3))
    assert torch.equal(layer.out_proj.weight, old["out_proj.weight"][:, 15:20].repeat(1, 6))  # columns 3e..4e-1
    assert torch.equal(layer.out_proj.bias, old["out_proj.bias"])  # shared: untouched
    assert_heads_equal(layer, 3)
    query, key = torch.randn(2, 3, 14), torch.randn(2, 5, 7)
    out, weights = layer(query, key, torch.randn(2, 5, 11), need_weights=True)
    assert out.shape == (2, 3, 13) and weights.shape == (2, 6, 3, 5)
    for head in range(6):
        assert torch.equal(weights[:, head], weights[:, 3])


def test_make_heads_identical_without_bias_and_one_head():
    torch.manual_seed(0)
    layer = MultiHeadAttention(12, 3, bias=False)
    assert head_parameter_difference(layer) > 0.0
    make_heads_identical(layer, 1)
    assert head_parameter_difference(layer, 2) == 0.0
    single = MultiHeadAttention(8, 1)
    old = single.q_proj.weight.detach().clone()
    make_heads_identical(single)
    assert torch.equal(single.q_proj.weight, old)


@pytest.mark.parametrize(
    "layer, source_head, kind, fragment",
    [
        (torch.nn.Linear(4, 4), 0, TypeError, "layer: expected a multihead.MultiHeadAttention"),
        (None, 0, TypeError, "layer"),
        ("mha", 5, ValueError, r"source_head: expected a head index in 0\.\.4 \(the layer has 5 heads\), got 5"),
        ("mha", -1, ValueError, r"source_head: expected a head index in 0\.\.4"),
        ("mha", True, TypeError, "source_head"),
        ("mha", 1.0, TypeError, "source_head"),
    ],
)
def test_make_heads_identical_rejects_bad_input_and_changes_nothing(layer, source_head, kind, fragment):
    torch.manual_seed(0)
    mha = MultiHeadAttention(15, 5)
    if layer == "mha":
        layer = mha
    old = {name: p.detach().clone() for name, p in mha.named_parameters()}
    with pytest.raises(kind, match=fragment):
        make_heads_identical(layer, source_head)
    for name, p in mha.named_parameters():
        assert torch.equal(p, old[name])
    with pytest.raises(kind, match=fragment.split(":")[0]):
        head_parameter_difference(layer, source_head)


# --- heads_divergence ----------------------------------------------------------------------------------------------


def jsd_bits(p: torch.Tensor, q: torch.Tensor) -> float:
    """Reference JSD of two rows over the keys they see (no zeros among them), in bits."""

    def entropy(r: torch.Tensor) -> float:
        return -sum(float(x) * math.log2(float(x)) for x in r)

    return entropy((p + q) / 2) - (entropy(p) + entropy(q)) / 2


def test_heads_divergence_is_the_mean_jsd_over_visible_keys():
    model = decoder(seed=4)
    batch = ids(2)[:2, :5]  # (2, 5)
    divergence = heads_divergence(model, batch, 1)
    assert divergence.shape == (4, 4) and divergence.dtype == torch.float64
    assert torch.equal(divergence, divergence.T) and torch.equal(
        divergence.diagonal(), torch.zeros(4, dtype=torch.float64)
    )
    from multihead.lab.inspect import capture

    with torch.no_grad(), capture(model, layers=[1]) as rec:
        model(batch)
    weights = rec.weights(1).double()  # (b, h, i, j)
    for a, b in [(0, 1), (1, 3), (2, 3)]:
        rows = [jsd_bits(weights[t, a, i, : i + 1], weights[t, b, i, : i + 1]) for t in range(2) for i in range(5)]
        assert float(divergence[a, b]) == pytest.approx(sum(rows) / len(rows), abs=1e-6)
    assert float(divergence[0, 1]) > 0.0


@pytest.mark.parametrize(
    "batch_ids, layer, kind, fragment",
    [
        (torch.zeros(2, 3), 0, TypeError, "batch_ids"),
        (torch.zeros(6, dtype=torch.long), 0, TypeError, "batch_ids"),
        (torch.zeros(2, 3, dtype=torch.long), 2, ValueError, r"layer: expected layer indices in 0\.\.1"),
        (torch.zeros(2, 3, dtype=torch.long), [0], TypeError, "layer"),
        (torch.zeros(2, 3, dtype=torch.long), -1, ValueError, "layer"),
    ],
)
def test_heads_divergence_rejects_bad_input(batch_ids, layer, kind, fragment):
    with pytest.raises(kind, match=fragment):
        heads_divergence(decoder(), batch_ids, layer)


def test_heads_divergence_restores_the_training_mode():
    model = decoder().train()
    heads_divergence(model, ids(), 0)
    assert model.training


# --- run_symmetry: the experiment of `multihead train symmetry`, from an induction run's settings ------------------


SYMMETRY = InductionSettings(
    layers=2, heads=2, hidden=16, vocab_size=9, half_length=4, min_half_length=2, batch=3, steps=4, log_every=2, seed=3
)


@pytest.fixture(scope="module")
def symmetry_run():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_symmetry(SYMMETRY)
    finally:
        torch.set_num_threads(saved)


def test_run_symmetry_trains_the_settings_model_both_ways(symmetry_run):
    assert isinstance(symmetry_run, SymmetryRun) and symmetry_run.settings is SYMMETRY
    result = symmetry_run.result
    assert result["config"] == dataclasses.asdict(SYMMETRY.model_config())
    assert (result["steps"], result["seed"], result["batch"], result["lr"]) == (4, 3, 3, SYMMETRY.lr)
    assert (result["half_length"], result["min_half_length"], result["vocab_size"]) == (4, 2, 9)
    assert result["identical_layers"] == [0, 1] and result["dtype"] == "float32"
    for name in ("random", "identical"):  # logs at steps 0, 2 and 4, every layer measured
        assert [entry["step"] for entry in result[name]["history"]] == [0, 2, 4]
        assert all(len(entry["divergence_mean"]) == 2 for entry in result[name]["history"])
    assert symmetry_run.stayed_identical is True and result["identical_stayed_identical"] is True
    assert all(value == 0.0 for entry in result["identical"]["history"] for value in entry["divergence_mean"])
    assert all(value > 0.0 for entry in result["random"]["history"] for value in entry["divergence_mean"])


def test_run_symmetry_is_symmetry_experiment_on_the_settings(symmetry_run):
    settings = {"half_length": 4, "min_half_length": 2, "vocab_size": 9, "batch": 3, "log_every": 2}
    direct = symmetry_experiment(SYMMETRY.model_config(), steps=4, seed=3, lr=SYMMETRY.lr, **settings)

    def measured(result):  # everything but the timings
        return {
            name: [{k: v for k, v in entry.items() if k != "tokens_per_s"} for entry in result[name]["history"]]
            for name in ("random", "identical")
        }

    assert measured(symmetry_run.result) == measured(direct)


def test_run_symmetry_saves_its_result(symmetry_run, tmp_path):
    written = symmetry_run.save(tmp_path / "out")  # the folder is made
    assert written["json"] == tmp_path / "out" / "symmetry.json"
    assert json.loads(written["json"].read_text()) == symmetry_run.result
    if "png" in written:  # matplotlib installed
        assert written["png"].read_bytes().startswith(b"\x89PNG")
    else:
        assert written.skipped == {"png": tmp_path / "out" / "symmetry.png"}
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^folder: expected a folder multihead can create and write files in"):
        symmetry_run.save(tmp_path / "file")


def test_run_symmetry_refuses_other_settings_before_training():
    with pytest.raises(TypeError, match="^settings: expected InductionSettings or None, got dict"):
        run_symmetry({"steps": 4})
    with pytest.raises(ValueError, match="identical_layers"):
        run_symmetry(SYMMETRY, identical_layers=[2])

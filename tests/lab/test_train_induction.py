"""The induction experiment (multihead.lab.train.induction) and `multihead train`: a 2-layer attention-only decoder
forms a previous-token head and induction heads, a 1-layer control does not, and ablation shows what the heads do.

The training runs are fixed-seed and sized to the CI budget: 2000 updates of the default settings (the phase change
comes at about 1000-1200 on this seed, see docs/train.md), one torch thread.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from multihead._errors import InputError
from multihead.cli import main
from multihead.lab.inspect import inspect_text
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE, read_behaviours
from multihead.lab.inspect.importance import ablated
from multihead.lab.models.decoder import Decoder, load_decoder
from multihead.lab.models.symbols import load_decoder_reader
from multihead.lab.train.induction import (
    InductionSettings,
    ablation_scores,
    direct_copying,
    probe_batch,
    probe_scores,
    run_induction,
)
from multihead.lab.train.scores import per_position_loss, repeated_tokens_loss
from support import is_input_error

CI_STEPS = 2000
INDUCTION_THRESHOLD = 0.4  # the induction role's threshold (roles.ROLE_RULES["induction"]); docs/train.md


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


@pytest.fixture(scope="module")
def two_layer():
    torch.set_num_threads(1)
    return run_induction(InductionSettings(steps=CI_STEPS, log_every=250, probe_size=32))


@pytest.fixture(scope="module")
def one_layer():
    torch.set_num_threads(1)
    return run_induction(InductionSettings(layers=1, steps=CI_STEPS, log_every=250, probe_size=32))


def test_two_layers_form_induction_heads_and_one_layer_does_not(two_layer, one_layer):
    final = two_layer.final
    induction, previous = final["induction"], final["previous_token"]
    assert induction.shape == previous.shape == (2, 4)
    # layer 1 holds induction heads; layer 0 cannot (it sees only tokens, not what preceded them earlier)
    assert float(induction[1].max()) > INDUCTION_THRESHOLD
    assert float(induction[0].max()) < 0.1
    # layer 0 holds the previous-token head the induction heads compose with
    assert float(previous[0].max()) > 0.4
    # the loss on the repeated half collapses; in-context learning: late context predicted far better than early
    assert final["loss"] < 0.5 * final["chance"]
    assert final["in_context_learning"] < -1.0
    control = one_layer.final
    assert float(control["induction"].max()) < INDUCTION_THRESHOLD
    assert control["loss"] > 0.7 * control["chance"]
    assert control["in_context_learning"] > final["in_context_learning"] + 1.0


def test_phase_change_is_visible_in_the_history(two_layer):
    history = two_layer.history
    assert [entry["step"] for entry in history] == list(range(250, CI_STEPS + 1, 250))
    scores = [max(entry["induction"][1]) for entry in history]
    losses = [entry["repeated_token_loss"] for entry in history]
    assert scores[0] < 0.1 and scores[-1] > INDUCTION_THRESHOLD  # the score rises from nothing ...
    assert losses[0] > 0.8 * two_layer.final["chance"] and losses[-1] < 0.5 * two_layer.final["chance"]  # as loss falls
    assert all(math.isfinite(entry["tokens_per_s"]) and entry["tokens_per_s"] > 0 for entry in history)


def test_induction_heads_copy_and_ablation_shows_the_circuit(two_layer):
    model, final = two_layer.model, two_layer.final
    probe = probe_batch(two_layer.settings)
    induction_heads = [head for head in range(4) if float(final["induction"][1, head]) > INDUCTION_THRESHOLD]
    assert induction_heads
    # copying: each induction head's own logits name the next token far above chance (1 / 23)
    copying = direct_copying(model, probe)
    assert torch.equal(copying, final["copying"])
    assert all(float(copying[1, head]) > 0.25 for head in induction_heads)
    assert float(copying[0].max()) < 0.15
    # ablating the induction heads sends the repeated-token loss back up to chance ...
    with torch.no_grad():
        base = float(repeated_tokens_loss(model(probe.ids), probe.ids, probe.repeated))
        with ablated(model, {1: induction_heads}):
            without = float(repeated_tokens_loss(model(probe.ids), probe.ids, probe.repeated))
    assert base == pytest.approx(final["loss"])
    assert without > 0.8 * final["chance"] > 2 * base
    # ... while the loss at tokens seen for the first time, which no head can predict, stays near chance
    with torch.no_grad():
        unseen = ~probe.repeated[:, :-1]  # (b, n - 1): predictions made at a token not seen before
        before = per_position_loss(model(probe.ids), probe.ids)[unseen].mean()
        with ablated(model, {1: induction_heads}):
            after = per_position_loss(model(probe.ids), probe.ids)[unseen].mean()
    assert abs(float(after - before)) < 0.2 * (without - base)
    assert float(before) > 0.9 * final["chance"]


def test_ablation_scores_are_each_heads_loss(two_layer):
    model, final = two_layer.model, two_layer.final
    probe = probe_batch(two_layer.settings)
    scores = ablation_scores(model, probe)
    assert torch.equal(scores["ablated_loss"], final["ablated_loss"])
    with torch.no_grad(), ablated(model, {0: [2]}):
        loss = float(repeated_tokens_loss(model(probe.ids), probe.ids, probe.repeated))
    assert float(scores["ablated_loss"][0, 2]) == pytest.approx(loss)
    gain = scores["chance"] - scores["loss"]
    assert torch.allclose(scores["ablation_gain_lost"], (scores["ablated_loss"] - scores["loss"]) / gain)


def test_probe_scores_match_a_recount(two_layer):
    probe = probe_batch(two_layer.settings)
    scores = probe_scores(two_layer.model, probe)
    assert torch.equal(scores["induction"], two_layer.final["induction"])
    assert probe.ids.shape == (32, 25)


def test_same_seed_same_run():
    settings = InductionSettings(steps=30, log_every=10, probe_size=8)
    first, second = run_induction(settings), run_induction(settings)
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [e["loss"] for e in first.history] == [e["loss"] for e in second.history]
    other = run_induction(dataclasses.replace(settings, seed=1))
    assert not torch.equal(other.model.token_embeddings.weight, first.model.token_embeddings.weight)


@pytest.mark.parametrize(
    ("field", "value", "error", "fragment"),
    [
        ("steps", 0, ValueError, "steps"),
        ("lr", 0.0, ValueError, "lr"),
        ("lr", float("nan"), ValueError, "lr"),
        ("weight_decay", -1.0, ValueError, "weight_decay"),
        ("seed", -1, ValueError, "seed"),
        ("seed", 1.5, ValueError, "seed"),
        ("heads", 3, ValueError, "hidden"),
        ("kv_heads", 3, ValueError, "kv_heads"),
        ("half_length", 1, ValueError, "half_length"),
        ("min_half_length", 13, ValueError, "min_half_length"),
        ("vocab_size", 1, ValueError, "vocab_size"),
        ("positions", "alibi", ValueError, "positions"),
        ("batch", 0, ValueError, "batch"),
    ],
)
def test_settings_refuse_bad_values(field, value, error, fragment):
    with pytest.raises(error, match=fragment):
        InductionSettings(**{field: value})


def test_saved_run_opens_in_inspect_with_induction_roles(two_layer, tmp_path):
    paths = two_layer.save(tmp_path / "run")
    assert {path.name for path in (tmp_path / "run").iterdir()} == {"model", "log.json", "curves.png"}
    log = json.loads(paths["log"].read_text())
    assert log["meta"]["task"] == "induction" and log["meta"]["settings"]["steps"] == CI_STEPS
    assert len(log["history"]) == CI_STEPS // 250
    reader = load_decoder_reader(paths["model"])
    probe = probe_batch(two_layer.settings)
    with torch.no_grad():
        assert torch.equal(reader.decoder(probe.ids), two_layer.model(probe.ids))
    saved = read_behaviours(paths["model"])
    assert set(saved) == {"self"} and set(saved["self"]) == {"prefix_matching", "copying"}
    text = reader.tokenizer.text(probe.ids[0].tolist())
    inspection = inspect_text(reader, text, behaviours=saved["self"])
    roles = inspection.role_stats.roles()
    labels = [[role.label for role in row] for row in roles]
    induction_heads = [h for h in range(4) if float(two_layer.final["induction"][1, h]) > INDUCTION_THRESHOLD]
    assert all(labels[1][head] == "induction" for head in induction_heads)
    assert "induction" not in labels[0]
    assert inspection.causal and inspection.part == "self"
    weights = inspection.weights  # (layers, heads, n, n): causal, rows sum to 1
    assert torch.all(weights.triu(1) == 0)
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("width", [60, 80, 100])
def test_the_training_bar_keeps_its_bar_and_time_left_at_any_width(width):
    """At 80 columns the scores on the bar's line took the bar's and the ETA's room: they go on a line below."""
    from rich.console import Console, Group

    from multihead.cli import training_progress

    console = Console(width=width, record=True, color_system=None, force_terminal=True)
    bar = training_progress(console)
    task = bar.add_task("training (induction)", total=3000, status="")
    bar.update(task, completed=1200, status="repeated-token loss 1.234 · induction 0.45 · 41,234 tokens/s " * 2)
    console.print(Group(*bar.get_renderables()))
    first, second = console.export_text().splitlines()
    assert first.startswith("training (induction) ") and first.count("\u2501") >= 5  # the bar's filled part
    assert first.rstrip().endswith("1200/3000 steps -:--:--")  # the time left (unknown yet), whole
    assert second.startswith("repeated-token loss 1.234") and len(second) <= width


def test_the_closing_notes_wrap_between_words(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "run"
    assert main(["train", "induction", "--steps", "20", "--layers", "1", "--heads", "2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines if str(tmp_path) not in line)  # paths stay whole
    joined = " ".join(line.strip() for line in lines)  # lines broken between words join back into the prose
    assert "prev: attention from t to t - 1. induction: attention from a repeated token to the token after" in joined
    assert "ablated: repeated-token loss with the head zeroed (unablated" in joined


def test_cli_train_then_inspect(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "induction", "--steps", "20", "--layers", "1", "--heads", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "repeated-token loss" in printed and "inspect it:" in printed
    assert all(column in printed for column in ("prev", "induction", "copies", "ablated", "L0H1"))
    assert (out / "model" / BEHAVIOURS_FILE).is_file() and (out / "curves.png").is_file()
    report_dir = tmp_path / "report"
    argv = ["inspect", "a b c d a b c", "--model", str(out / "model"), "--format", "terminal,json", "--out"]
    assert main([*argv, str(report_dir)]) == 0
    report = json.loads((report_dir / "inspect.json").read_text())
    assert report["causal"] is True and report["tokens"][0] == "<bos>"
    # the run's probes, and the head detectors' other measures (its own prefix matching, on its task, kept)
    assert set(report["behaviours"]) == {"prefix_matching", "copying", "previous_token", "duplicate_token", "sink"}
    saved = read_behaviours(out / "model")["self"]
    torch.testing.assert_close(
        torch.tensor(report["behaviours"]["prefix_matching"], dtype=torch.float64),
        saved["prefix_matching"],
        atol=1e-6,
        rtol=0,
    )
    printed = capsys.readouterr().out
    assert "behaviour probes" in printed and "prev-tok/dup-tok" in printed


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--steps", "0"], "--steps:"),
        (["--heads", "3"], "--hidden:"),
        (["--kv-heads", "3"], "--kv-heads:"),
        (["--lr", "-1"], "--lr:"),
        (["--seed", "-2"], "--seed:"),
    ],
)
def test_cli_train_refuses_bad_options_in_one_line(argv, fragment, tmp_path, capsys):
    assert main(["train", "induction", *argv, "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert fragment in error and "Traceback" not in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_run_goes_on_from_a_checkpoint_at_a_longer_length(tmp_path, capsys):
    # the length curriculum of docs/long-context.md: a short run's decoder, trained on at a longer half length
    short = tmp_path / "short"
    assert main(["train", "induction", "--steps", "5", "--layers", "1", "--heads", "2", "--out", str(short)]) == 0
    longer = tmp_path / "long"
    argv = ["train", "induction", "--from", str(short / "model"), "--half-length", "20", "--steps", "3"]
    assert main([*argv, "--lr", "1e-12", "--out", str(longer)]) == 0
    before, after = load_decoder(short / "model"), load_decoder(longer / "model")
    assert before.config.max_positions == 25 and after.config == dataclasses.replace(before.config, max_positions=41)
    for name, weight in before.state_dict().items():  # the same weights, moved by a step of 1e-12 at most
        torch.testing.assert_close(after.state_dict()[name], weight, atol=1e-9, rtol=0)
    assert "trained a 1-layer, 2-head" in capsys.readouterr().out


def test_a_learned_decoder_too_short_for_the_task_is_refused_and_left_as_it_was():
    model = Decoder(InductionSettings(positions="learned").model_config())
    settings = InductionSettings(half_length=20, steps=1)
    with pytest.raises(ValueError) as raised:
        run_induction(settings, model=model)
    assert is_input_error(raised.value, ValueError) and "model: expected a decoder with 41 positions" in str(
        raised.value
    )
    assert model.config.max_positions == 25


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--layers", "2"], "--from: expected no --layers beside it"),
        (["--half-length", "3"], "--from:"),  # a folder with no decoder in it (and repeats of 3 alone)
        (["--half-length", "1"], "--half-length:"),
    ],
)
def test_cli_from_refuses_in_one_line(argv, fragment, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "induction", "--from", str(tmp_path / "empty"), *argv, "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert fragment in error and "Traceback" not in error and len(error.strip().splitlines()) == 1


def test_cli_reverse_refuses_a_half_length(tmp_path, capsys):
    assert main(["train", "reverse", "--half-length", "4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--half-length: expected an option of `multihead train induction` or `multihead train symmetry`" in err
    assert "got `multihead train reverse --half-length 4`" in err


def test_inspect_refuses_a_symbol_outside_the_vocabulary(two_layer, tmp_path, capsys):
    folder = two_layer.save(tmp_path / "run")["model"]
    assert main(["inspect", "a b Z", "--model", str(folder), "--format", "terminal"]) == 2
    assert "'Z'" in capsys.readouterr().err


def test_damaged_behaviours_file_is_one_error(two_layer, tmp_path):
    folder = two_layer.save(tmp_path / "run")["model"]
    path = folder / BEHAVIOURS_FILE
    data = json.loads(path.read_text())
    data["behaviours"]["speed"] = [[1.0]]
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="behaviours.json.*speed"):
        read_behaviours(folder)
    data["behaviours"] = {"copying": [[1.0, 2.0], [3.0]]}
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="behaviours.json"):
        read_behaviours(folder)
    path.write_text("{")
    with pytest.raises(InputError, match="behaviours.json"):
        read_behaviours(folder)


def test_heads_importance_on_a_checkpoint_measures_its_task(two_layer, tmp_path, capsys):
    folder = two_layer.save(tmp_path / "run")["model"]
    out = tmp_path / "importance"
    assert main(["heads", "importance", "--model", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "repeated-token loss" in printed and "most important: L" in printed
    saved = json.loads((out / "importance.json").read_text())
    expected = two_layer.final["ablated_loss"] - two_layer.final["loss"]
    assert torch.allclose(torch.tensor(saved["scores"], dtype=torch.float64), expected, atol=1e-6)
    assert saved["ranking"][0]["score"] == pytest.approx(float(expected.max()), abs=1e-6)


def test_cli_reverse_train_inspect_and_importance(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "reverse", "--steps", "60", "--heads", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "encoder-decoder" in printed and "aligned" in printed and "inspect it:" in printed
    saved = read_behaviours(out / "model")
    assert set(saved) == {"cross"} and saved["cross"]["alignment"].shape == (1, 2)
    report = tmp_path / "report"
    argv = ["inspect", "--model", str(out / "model"), "--format", "json", "--out", str(report)]  # part: cross
    assert main(argv) == 0
    data = json.loads((report / "inspect.json").read_text())
    assert data["part"] == "cross" and len(data["key_tokens"]) == 12 and data["tokens"][0] == "<bos>"
    assert set(data["behaviours"]) == {"alignment"}
    assert main(["heads", "importance", "--model", str(out / "model"), "--out", str(tmp_path / "imp")]) == 0
    assert "cross-attention layers" in capsys.readouterr().out
    assert main(["train", "reverse", "--layers", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "--layers:" in capsys.readouterr().err


def test_cli_symmetry_keeps_identical_heads_identical(tmp_path, capsys):
    out = tmp_path / "symmetry"
    assert main(["train", "symmetry", "--steps", "30", "--heads", "2", "--hidden", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "identical heads stayed bitwise identical at every log" in printed
    result = json.loads((out / "symmetry.json").read_text())
    assert result["identical_stayed_identical"] is True
    assert all(value == 0.0 for entry in result["identical"]["history"] for value in entry["divergence_mean"])
    assert all(value > 0.01 for entry in result["random"]["history"] for value in entry["divergence_mean"])
    assert (out / "symmetry.png").is_file()


def test_inspect_names_the_detected_heads_of_a_trained_decoder(two_layer, tmp_path):
    """`multihead inspect` on the trained decoder runs the head detectors: its layer-0 previous-token head is
    labelled prev-tok, its induction heads keep the run's probes' induction label, and the detectors' scores are
    columns of the HTML report."""
    from multihead.lab.circuits import probe_heads

    folder = two_layer.save(tmp_path / "run")["model"]
    out = tmp_path / "report"
    assert main(["inspect", "--model", str(folder), "--format", "json,html", "--out", str(out)]) == 0
    report = json.loads((out / "inspect.json").read_text())
    labels = [[role["label"] for role in row] for row in report["roles"]]
    previous_head = int(two_layer.final["previous_token"][0].argmax())
    assert labels[0][previous_head] == "prev-tok"
    induction_heads = [h for h in range(4) if float(two_layer.final["induction"][1, h]) > INDUCTION_THRESHOLD]
    assert induction_heads and all(labels[1][head] == "induction" for head in induction_heads)
    reader = load_decoder_reader(folder)
    detected = probe_heads(reader, reader.tokenizer)
    torch.testing.assert_close(
        torch.tensor(report["behaviours"]["previous_token"]), detected.previous_token, atol=1e-6, rtol=0
    )
    page = (out / "report.html").read_text()
    assert all(f"{name} (detector)" in page for name in ("previous_token", "duplicate_token", "sink"))


def test_circuits_find_the_induction_circuit_the_run_grew(two_layer):
    """The circuits tools on the trained decoder (Olsson et al.): the detectors name the heads the run's own probes
    name, and patching each head's output from a repeated sequence into one whose first half is scrambled puts
    the answer back through the layer-1 induction heads, while the layer-0 previous-token head alone moves it to
    the scrambled token (its clean keys point the induction heads at a position holding the corrupted value): path
    patching finds that route through the induction heads' keys, not their queries."""
    from multihead.lab.circuits import (
        activation_patching,
        agreement,
        attribution_patching,
        composition_scores,
        detect_heads,
        path_patching,
        repeated_random_tokens,
    )

    settings, final = two_layer.settings, two_layer.final
    ids = repeated_random_tokens(settings.vocab_size, settings.half_length, batch=8, seed=5, bos=0, low=1)
    found = detect_heads(two_layer.model, ids)
    assert float(found.induction[1].min()) > 0.3 and float(found.induction[0].max()) < 0.1
    previous_head = int(final["previous_token"][0].argmax())
    assert int(found.previous_token[0].argmax()) == previous_head and float(found.previous_token[0].max()) > 0.4

    half = settings.half_length
    clean = ids[:, :-1]  # [BOS] x_1 .. x_L x_1 .. x_{L-1}: the next token is x_L
    corrupt = clean.clone()
    corrupt[:, 1 : half + 1] = torch.randint(
        1, settings.vocab_size, (8, half), generator=torch.Generator().manual_seed(7)
    )
    answer, wrong = ids[:, -1], corrupt[:, half]  # x_L, and the token that followed in the scrambled half
    exact = activation_patching(two_layer.model, clean, corrupt, answer=answer, wrong=wrong)
    assert float(exact.scores[1].min()) > 0.1 and float(exact.scores[1].sum()) > 0.8
    assert int(exact.scores[0].abs().argmax()) == previous_head and float(exact.scores[0, previous_head]) < -0.3
    estimate = attribution_patching(two_layer.model, clean, corrupt, answer=answer, wrong=wrong)
    assert agreement(exact, estimate).correlation > 0.8
    # K-composition: the previous-token head acts through the induction heads' keys, not their queries
    induction_heads = [(1, head) for head in range(settings.heads)]
    through = {
        what: path_patching(
            two_layer.model, clean, corrupt, answer=answer, wrong=wrong, receivers=induction_heads, what=what
        )
        for what in ("k", "q")
    }
    assert float(through["k"].scores[0, previous_head]) < -0.3
    assert abs(float(through["q"].scores[0, previous_head])) < 0.1
    # the weights say it too (Elhage et al.): the previous-token head K-composes most with every induction head,
    # and more than it Q-composes with it
    keys, queries = composition_scores(two_layer.model, "K"), composition_scores(two_layer.model, "Q")
    for head in range(settings.heads):
        assert int(keys[0, :, 1, head].argmax()) == previous_head
        assert float(keys[0, previous_head, 1, head]) > float(queries[0, previous_head, 1, head])

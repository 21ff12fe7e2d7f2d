"""`multihead inspect` on a transformers checkpoint with learned attention sinks (a tiny gpt-oss saved locally): each
head's share on its sink is a statistic, a head that parks its weight there gets the role that says so, and the
legend says what it means."""

from __future__ import annotations

import json

from hf_checkpoints import save
from multihead.cli import main


def test_a_head_that_parks_its_weight_on_its_learned_sink_is_labelled_so(tmp_path, capsys):
    folder = save("gpt_oss", tmp_path / "gpt_oss")  # head 0 of each layer: sink logit +8; the others: -8
    out = tmp_path / "report"
    code = main(
        ["inspect", "The bank was full of money.", "--model", str(folder), "--format", "terminal,json"]
        + ["--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "learned sink" in printed and "for the layer's learned sink logit (gpt-oss)" in printed
    report = json.loads((out / "inspect.json").read_text())
    for layer_roles, layer_stats in zip(report["roles"], report["text_stats"]["stats"], strict=True):
        shares = [head["learned_sink"] for head in layer_stats]  # each head's share on its sink
        assert layer_roles[0]["label"] == "learned sink" and shares[0] > 0.9
        assert all(role["label"] != "learned sink" for role in layer_roles[1:])
        assert all(share < 0.01 for share in shares[1:])

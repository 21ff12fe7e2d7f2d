"""`multihead inspect` on a hybrid transformers checkpoint (a tiny Qwen3-Next saved locally: linear-attention layers
0 and 2, attention layers 1 and 3): it reads the two attention layers, numbers them 0 and 1, and names each one's
module path. It exited 2 before, taking the linear-attention modules for attention layers."""

from __future__ import annotations

import json

from hf_checkpoints import save
from multihead.cli import main


def test_inspect_reads_a_hybrids_attention_layers_and_names_their_modules(tmp_path, capsys):
    folder = save("qwen3_next", tmp_path / "qwen3_next")
    out = tmp_path / "report"
    code = main(
        ["inspect", "The bank was full of money.", "--model", str(folder), "--format", "json,terminal"]
        + ["--out", str(out)]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "layers: 0 = layers.1.self_attn, 1 = layers.3.self_attn" in printed  # paths in the text model read
    report = json.loads((out / "inspect.json").read_text())
    assert report["layers"] == [0, 1]
    assert report["layer_modules"] == ["layers.1.self_attn", "layers.3.self_attn"]
    assert len(report["weights"]) == 2 and len(report["roles"]) == 2

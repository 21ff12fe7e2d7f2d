"""The induction experiment of Olsson et al. 2022, end to end: train a small decoder on repeated random segments,
watch its heads over training, and test what the heads its pattern points at do.

    run = run_induction(InductionSettings(layers=2, steps=3000))
    run.final["induction"]            # (layers, h) prefix-matching score of every head on the probe
    run.final["copying"]              # (layers, h) how often the head's own logits name the next token
    run.final["ablated_loss"]         # (layers, h) repeated-token loss with the head zeroed
    run.save("multihead-train")       # model/ (opens with multihead inspect --model), log.json, curves.png

Training reads repeats of several lengths (``min_half_length`` .. ``half_length``: each sequence repeats L_i random
tokens after 2 (L - L_i) filler tokens), and so does the **probe**, ``probe_size`` held-out sequences drawn once
from ``seed + 1`` and read at every log. One fixed L would let a single rotary layer find the earlier copy at a
fixed distance: on the fixed-L probe TransformerLens uses, our 1-layer control's best head scores 0.42 (it
attends at offset L - 1), though one layer cannot match prefixes. On the probe:

- ``previous_token`` (layers, h): mean attention from position t to t - 1 (TransformerLens' score);
- ``induction`` (layers, h): mean attention from each repeated token to the token after its earlier occurrence
  (prefix matching; :func:`~multihead.lab.train.scores.prefix_matching_score`, TransformerLens' induction score with
  one L per sequence);
- ``repeated_token_loss``: the loss of the predictions made at repeated tokens, which only induction makes
  possible; ``in_context_learning``: loss late in the context minus loss early in it (Olsson et al.'s score);

and at the end, per head:

- ``copying`` (layers, h): :func:`direct_copying`, the share of those predictions the head's own contribution to
  the logits gets right;
- ``ablated_loss`` (layers, h): the repeated-token loss with the head's output zeroed, and
  ``ablation_gain_lost`` (layers, h) = (ablated_loss - loss) / (chance - loss), the share of the in-context gain
  lost, where chance = log(vocab_size - 1) is the loss of a model that ignores the context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multihead._errors import bad_argument, describe
from multihead._figures import Written, draw_figure
from multihead._userfiles import output_folder, writing
from multihead.capture import capture
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE, plain_measures, read_behaviours, write_behaviours
from multihead.lab.inspect.importance import ablated
from multihead.lab.models.contract import evaluating
from multihead.lab.models.decoder import Decoder, DecoderConfig
from multihead.lab.models.symbols import SymbolTokenizer, task_symbols
from multihead.lab.models.tasks import InductionBatch, induction_batch
from multihead.lab.train.loop import History, check_run_settings, history_to_json, plot_history, train_run
from multihead.lab.train.scores import (
    in_context_learning_score,
    per_position_loss,
    prefix_matching_score,
    previous_token_score,
    repeated_tokens_loss,
)

__all__ = [
    "BEHAVIOURS_FILE",
    "InductionSettings",
    "InductionRun",
    "probe_batch",
    "probe_scores",
    "ablation_scores",
    "run_induction",
    "config_for_task",
    "read_behaviours",
    "write_behaviours",
]


@dataclass(frozen=True)
class InductionSettings:
    """One induction run: the model, the task and the optimiser, validated on construction.

    Model: ``layers``, ``heads``, ``kv_heads`` (None: = heads), ``hidden``, ``mlp`` (None: attention-only, as the
    paper's small models), ``positions`` ("rotary" or "learned"). Task: ``vocab_size`` (with BOS), ``half_length``
    L (the probe's and the longest training repeat), ``min_half_length`` (the shortest training repeat; None: all
    L). Optimiser: ``batch``, ``steps``, ``lr`` and ``weight_decay`` (AdamW), ``seed`` (the initialisation and the
    batches), ``log_every`` (probe every so many steps), ``probe_size`` (sequences in the probe).
    """

    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    hidden: int = 64
    mlp: int | None = None
    positions: str = "rotary"
    vocab_size: int = 24
    half_length: int = 12
    min_half_length: int | None = 4
    batch: int = 16
    steps: int = 3000
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 100
    probe_size: int = 64

    def __post_init__(self) -> None:
        check_run_settings(self)
        self.model_config()  # the model's fields, checked by DecoderConfig
        induction_batch(  # the task's fields, checked by the task on a one-sequence draw
            1,
            self.half_length,
            self.vocab_size,
            generator=torch.Generator().manual_seed(0),
            min_half_length=self.min_half_length,
        )

    def model_config(self) -> DecoderConfig:
        """The decoder these settings train: positions for BOS and two copies of the longest segment."""
        return DecoderConfig(
            vocab_size=self.vocab_size,
            max_positions=2 * self.half_length + 1,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            mlp=self.mlp,
            positions=self.positions,
        )


def probe_batch(settings: InductionSettings, device: torch.device | str = "cpu") -> InductionBatch:
    """The fixed probe: ``probe_size`` sequences drawn as training draws them (repeats of ``min_half_length`` ..
    ``half_length`` tokens), held out: from ``seed + 1``."""
    generator = torch.Generator(device=device).manual_seed(settings.seed + 1)
    return _task_batch(settings, settings.probe_size, generator)


def _task_batch(settings: InductionSettings, size: int, generator: torch.Generator) -> InductionBatch:
    """``size`` sequences of the run's task: repeats of ``min_half_length`` .. ``half_length`` tokens."""
    return induction_batch(
        size, settings.half_length, settings.vocab_size, generator=generator, min_half_length=settings.min_half_length
    )


def _lm_loss(model: torch.nn.Module, batch: InductionBatch) -> torch.Tensor:
    """The training objective: next-token cross-entropy at every position (the model is not told where the
    repeat is)."""
    return per_position_loss(model(batch.ids), batch.ids).mean()


@torch.no_grad()
def probe_scores(model: Decoder, probe: InductionBatch) -> dict[str, Any]:
    """Every head's previous-token and induction (prefix-matching) scores on ``probe``, (layers, h) each, with
    the repeated-token loss and the in-context learning score (see the module docstring)."""
    with evaluating(model), capture(model) as recorder:
        logits = model(probe.ids)  # (b, n, vocab)
    weights = [recorder.weights(layer) for layer in range(len(model.attention_layers))]  # each (b, h, n, n)
    return {
        "previous_token": previous_token_score(weights),
        "induction": prefix_matching_score(weights, probe.previous),
        "repeated_token_loss": float(repeated_tokens_loss(logits, probe.ids, probe.repeated)),
        "in_context_learning": float(in_context_learning_score(per_position_loss(logits, probe.ids))),
    }


@torch.no_grad()
def direct_copying(model: Decoder, probe: InductionBatch) -> torch.Tensor:
    """(layers, h): for each head, the share of the predictions made at repeated tokens where the head's own
    contribution to the logits ranks the correct next token first (chance: 1 / (vocab_size - 1)).

    A head's contribution is its output through its slice of W^O, the final LayerNorm linearised at the actual
    residual (centred, divided by the residual's standard deviation, scaled by the LayerNorm's weight) and the
    unembedding: the direct path of Elhage et al. 2021, which is a last-layer head's only path to the logits in an
    attention-only model. An induction head copies: attending to the token after the earlier occurrence, it
    raises that token's logit.
    """
    residuals: list[torch.Tensor] = []
    handle = model.final_norm.register_forward_pre_hook(lambda module, args: residuals.append(args[0]))
    try:
        with evaluating(model), capture(model, weights=False, outputs=True) as recorder:
            model(probe.ids)
    finally:
        handle.remove()
    residual = residuals[-1]  # (b, n, hidden): what the final LayerNorm reads
    norm = model.final_norm
    scale = norm.weight / (residual.var(dim=-1, unbiased=False, keepdim=True) + norm.eps).sqrt()  # (b, n, hidden)
    unembedding = model.token_embeddings.weight if model.lm_head is None else model.lm_head.weight  # (V, hidden)
    chosen = probe.repeated[:, :-1]  # (b, n - 1): position t, a repeated token, predicts token t + 1
    targets = probe.ids[:, 1:]  # (b, n - 1)
    scores = []
    for layer, attention in enumerate(model.attention_layers):
        outputs = recorder.outputs(layer)[:, :, :-1]  # (b, h, n - 1, e)
        heads, width = attention.num_heads, attention.value_head_dim
        w_o = attention.out_proj.weight.view(-1, heads, width)  # (hidden, h, e): head h's columns
        contribution = torch.einsum("bhie,dhe->bhid", outputs, w_o)  # (b, h, n - 1, hidden)
        contribution = contribution - contribution.mean(dim=-1, keepdim=True)
        logits = (contribution * scale[:, None, :-1]) @ unembedding.T  # (b, h, n - 1, V)
        hits = (logits.argmax(dim=-1) == targets[:, None]) & chosen[:, None]  # (b, h, n - 1)
        scores.append(hits.sum(dim=(0, 2)).double() / chosen.sum())
    return torch.stack(scores)  # (layers, h)


@torch.no_grad()
def ablation_scores(model: Decoder, probe: InductionBatch) -> dict[str, Any]:
    """Zero-ablate each head alone and read the repeated-token loss on ``probe``: ``ablated_loss`` (layers, h),
    ``ablation_gain_lost`` (layers, h) = (ablated - loss) / (chance - loss), and ``loss`` and ``chance`` (see the
    module docstring). A model that has not learned the task (loss within 0.05 of chance) gets NaN shares."""
    layers = model.attention_layers
    with evaluating(model):
        loss = float(repeated_tokens_loss(model(probe.ids), probe.ids, probe.repeated))
        ablated_loss = torch.zeros(len(layers), layers[0].num_heads, dtype=torch.float64)
        for layer, attention in enumerate(layers):
            for head in range(attention.num_heads):
                with ablated(model, {layer: [head]}):
                    logits = model(probe.ids)
                ablated_loss[layer, head] = float(repeated_tokens_loss(logits, probe.ids, probe.repeated))
    chance = math.log(model.config.vocab_size - 1)  # tokens are uniform over the vocabulary but BOS
    gain = chance - loss
    copying = (ablated_loss - loss) / gain if gain > 0.05 else torch.full_like(ablated_loss, math.nan)
    return {"loss": loss, "chance": chance, "ablated_loss": ablated_loss, "ablation_gain_lost": copying}


@dataclass
class InductionRun:
    """A finished induction run: its settings, the trained model (eval mode), the history of its logs (loss,
    tokens/s and :func:`probe_scores` at every log) and ``final``: the last probe with :func:`ablation_scores`."""

    settings: InductionSettings
    model: Decoder
    history: History
    final: dict[str, Any]

    def behaviours(self) -> dict[str, torch.Tensor]:
        """The probe measures the roles weigh (:meth:`multihead.lab.inspect.HeadStats.with_behaviours`), (layers, h)."""
        return {"prefix_matching": self.final["induction"], "copying": self.final["copying"]}

    def save(self, folder: str | Path) -> Written:
        """Write the run into ``folder``: ``model/`` (the decoder, its symbols and its behaviours: open it with
        ``multihead inspect --model``), ``log.json`` (settings, history, final scores) and ``curves.png``
        (left out without matplotlib: in the result's ``skipped``). Returns {what: path}."""
        out = output_folder("folder", folder)
        model_dir = out / "model"
        with writing("folder", model_dir):
            self.model.save(model_dir)
            SymbolTokenizer(task_symbols(self.settings.vocab_size), max_length=1).save(model_dir)
            write_behaviours(model_dir, self.behaviours(), task="induction", part="self", settings=self.settings)
        meta = {"task": "induction", "settings": dataclasses.asdict(self.settings), "final": plain_measures(self.final)}
        log = Path(history_to_json(self.history, out / "log.json", meta=meta))
        written = Written(model=model_dir, log=log)
        keys = ["repeated_token_loss", "previous_token", "induction"]
        draw_figure(written, "curves", out / "curves.png", lambda path: plot_history(self.history, path, keys=keys))
        return written


def config_for_task(model: Decoder, settings: InductionSettings) -> DecoderConfig:
    """The config ``model`` trains on the task of ``settings`` with: its own, or for a rotary decoder with fewer
    positions than the task's sequences, its own with positions for them (rotary positions hold no weights, so
    nothing else changes). Raises ValueError naming ``model`` for a decoder that cannot read the task."""
    config = model.config
    if config.vocab_size != settings.vocab_size:
        raise bad_argument(
            "model",
            f"a decoder of the task's vocab_size = {settings.vocab_size}",
            f"vocab_size = {config.vocab_size}",
            "train the decoder of a run on this task, or set vocab_size in the settings to the decoder's",
        )
    needed = settings.model_config().max_positions
    if config.max_positions >= needed:
        return config
    if config.positions != "rotary":
        raise bad_argument(
            "model",
            f"a decoder with {needed} positions (2 x half_length + 1)",
            f"{config.max_positions} learned positions",
            f"train at half_length <= {(config.max_positions - 1) // 2}, or start from a rotary decoder",
        )
    return dataclasses.replace(config, max_positions=needed)


def run_induction(
    settings: InductionSettings = InductionSettings(),
    *,
    on_log: Callable[[int, Mapping[str, Any]], None] | None = None,
    model: Decoder | None = None,
) -> InductionRun:
    """Train a decoder on the induction task with ``settings`` and measure its heads (see the module docstring).

    ``on_log(step, scores)``: called at every log with the probe's scores (a progress bar goes here).
    ``model``: train this decoder instead of a new one (e.g. an earlier run's, at a longer ``half_length``); the
    settings' model fields are then not used. It must read the task: the task's vocab_size, and positions for
    2 x half_length + 1 tokens. A rotary decoder with fewer is given them (its config's ``max_positions``): its
    positions carry over to any length. Raises ValueError naming ``model`` for one that cannot read the task.
    """
    if not isinstance(settings, InductionSettings):
        raise bad_argument(
            "settings", "InductionSettings", describe(settings), "pass InductionSettings(...)", kind=TypeError
        )
    if model is None:
        torch.manual_seed(settings.seed)  # the initialisation, reproducible from the seed
        model = Decoder(settings.model_config(), name="induction")
    elif not isinstance(model, Decoder):
        raise bad_argument("model", "a Decoder", describe(model), "pass a multihead.lab.models.Decoder", kind=TypeError)
    else:
        model.config = config_for_task(model, settings)  # checked first: a refused model is left as it was
    device = model.token_embeddings.weight.device
    probe = probe_batch(settings, device)

    def make_batch(generator: torch.Generator) -> InductionBatch:
        return _task_batch(settings, settings.batch, generator)

    history = train_run(model, settings, make_batch, _lm_loss, lambda: probe_scores(model, probe), on_log)
    final = {**probe_scores(model, probe), **ablation_scores(model, probe), "copying": direct_copying(model, probe)}
    return InductionRun(settings, model.eval(), history, final)

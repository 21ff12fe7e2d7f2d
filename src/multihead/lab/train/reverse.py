"""The reverse task, end to end: train a small encoder-decoder to write its source backwards, watch its
cross-attention heads learn the alignment (target position s reads source position L - 1 - s) over training,
and test by ablation which heads carry it.

    run = run_reverse(ReverseSettings())          # about 12 s on one CPU thread
    run.final["alignment"]            # (decoder_layers, h): share of target positions whose argmax is aligned
    run.final["ablated_loss"]         # (decoder_layers, h): the teacher-forced loss with that cross head zeroed
    run.final["exact_match"]          # share of held-out sources greedy decoding reverses exactly
    run.save("multihead-train")       # model/ (opens with load_seq2seq_reader), log.json, curves.png

Positions are **learned** by default: cross-attention never takes rotary, so with rotary positions a cross head
can only match on the position the encoder's self-attention writes into the memory, which a rotary (relative)
layer recovers slowly, from the sequence's edges. Learned tables give the target position s (the query) and the
source position L - 1 - s (the key) absolute embeddings a cross head pairs at once. Measured with the defaults
(1 thread, about 12 s): every cross head aligns at >= 0.99 by update 50 and greedy decoding reverses all 128 probe
sources; with positions="rotary" the heads are at 0.15 at update 100, 0.63 at 400, 0.96 at 800 (exact match 0.87,
about 30 s).

The **probe** is ``probe_size`` held-out sequences drawn once from ``seed + 1`` and read at every log:

- ``alignment`` (decoder_layers, h): :func:`multihead.lab.train.scores.alignment_accuracy` of every cross head;
- ``probe_loss``: the teacher-forced cross-entropy; ``accuracy``: the share of target tokens predicted right
  (teacher-forced, argmax);

and at the end, per cross head, ``ablated_loss`` (the loss with that head's output zeroed) and, for the whole
model, ``exact_match``: the share of probe sources whose greedy decoding (:meth:`Seq2Seq.generate`) is their
exact reversal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from multihead._errors import bad_argument, describe
from multihead._figures import Written, draw_figure
from multihead._userfiles import output_folder, writing
from multihead.capture import capture
from multihead.lab.inspect.behaviours import plain_measures, write_behaviours
from multihead.lab.inspect.importance import ablated
from multihead.lab.models.contract import evaluating
from multihead.lab.models.seq2seq import Seq2Seq, Seq2SeqConfig
from multihead.lab.models.symbols import SymbolTokenizer, task_symbols
from multihead.lab.models.tasks import BOS, ReverseBatch, reverse_batch
from multihead.lab.train.loop import History, check_run_settings, history_to_json, plot_history, train_run
from multihead.lab.train.scores import alignment_accuracy

__all__ = ["ReverseSettings", "ReverseRun", "probe_batch", "probe_scores", "ablation_scores", "run_reverse"]


@dataclass(frozen=True)
class ReverseSettings:
    """One reverse run: the model, the task and the optimiser, validated on construction.

    Model: ``encoder_layers``, ``decoder_layers``, ``heads``, ``kv_heads`` (None: = heads), ``hidden``, ``mlp``
    (None: attention-only), ``positions`` ("learned", the default, or "rotary"; see the module docstring).
    Task: ``vocab_size`` (with BOS, the decoder's start token), ``length`` L (source and target tokens).
    Optimiser: ``batch``, ``steps``, ``lr`` and ``weight_decay`` (AdamW), ``seed`` (the initialisation and the
    batches), ``log_every`` (probe every so many steps), ``probe_size`` (sequences in the probe).
    """

    encoder_layers: int = 1
    decoder_layers: int = 1
    heads: int = 4
    kv_heads: int | None = None
    hidden: int = 64
    mlp: int | None = None
    positions: str = "learned"
    vocab_size: int = 24
    length: int = 12
    batch: int = 32
    steps: int = 800
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 50
    probe_size: int = 128

    def __post_init__(self) -> None:
        check_run_settings(self)
        self.model_config()  # the model's fields, checked by Seq2SeqConfig
        if self.vocab_size < 3:  # BOS and at least two symbols, or there is nothing to reverse
            raise bad_argument(
                "vocab_size", "an int >= 3 (BOS and two symbols)", describe(self.vocab_size), "pass e.g. 16"
            )
        reverse_batch(1, self.length, self.vocab_size, generator=torch.Generator().manual_seed(0))  # the task's

    def model_config(self) -> Seq2SeqConfig:
        """The encoder-decoder these settings train: ``length + 1`` positions (greedy decoding of ``length``
        tokens reads the start token first)."""
        return Seq2SeqConfig(
            vocab_size=self.vocab_size,
            max_positions=self.length + 1,
            hidden=self.hidden,
            encoder_layers=self.encoder_layers,
            decoder_layers=self.decoder_layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            mlp=self.mlp,
            positions=self.positions,
        )


def probe_batch(settings: ReverseSettings, device: torch.device | str = "cpu") -> ReverseBatch:
    """The fixed held-out probe: ``probe_size`` sources of ``length`` tokens and their reversal, from
    ``seed + 1`` (training draws from ``seed``)."""
    generator = torch.Generator(device=device).manual_seed(settings.seed + 1)
    return reverse_batch(settings.probe_size, settings.length, settings.vocab_size, generator=generator)


def _loss(model: torch.nn.Module, batch: ReverseBatch) -> torch.Tensor:
    """Teacher-forced cross-entropy of the target, mean over every target token."""
    logits = model(batch.source, batch.decoder_input)  # (b, L, vocab)
    return F.cross_entropy(logits.flatten(0, 1), batch.target.flatten())


def _count_tokens(batch: ReverseBatch) -> int:
    return batch.source.numel() + batch.decoder_input.numel()


@torch.no_grad()
def probe_scores(model: Seq2Seq, probe: ReverseBatch) -> dict[str, Any]:
    """``alignment`` (decoder_layers, h): the alignment accuracy of every cross-attention head on ``probe``;
    ``probe_loss``: the teacher-forced cross-entropy (not ``loss``: the training log keeps that name for the
    training batches'); ``accuracy``: the share of target tokens predicted right."""
    with evaluating(model), capture(model, part="cross") as recorder:
        logits = model(probe.source, probe.decoder_input)  # (b, L, vocab)
    weights = [recorder.weights(layer) for layer in range(len(model.cross_layers))]  # each (b, h, L, L)
    return {
        "alignment": alignment_accuracy(weights, probe.alignment),
        "probe_loss": float(F.cross_entropy(logits.flatten(0, 1), probe.target.flatten())),
        "accuracy": float((logits.argmax(-1) == probe.target).double().mean()),
    }


@torch.no_grad()
def exact_match(model: Seq2Seq, probe: ReverseBatch) -> float:
    """The share of ``probe`` sources whose greedy decoding is exactly their reversal."""
    length = probe.source.shape[1]
    generated = model.generate(probe.source, length, start_id=BOS)[:, 1:]  # (b, L): the start token dropped
    return float((generated == probe.target).all(dim=1).double().mean())


@torch.no_grad()
def ablation_scores(model: Seq2Seq, probe: ReverseBatch) -> dict[str, Any]:
    """Zero-ablate each cross-attention head alone and read the teacher-forced loss on ``probe``: ``loss`` (the
    unablated one) and ``ablated_loss`` (decoder_layers, h)."""
    layers = model.cross_layers
    with evaluating(model):
        loss = float(_loss(model, probe))
        ablated_loss = torch.zeros(len(layers), layers[0].num_heads, dtype=torch.float64)
        for layer, attention in enumerate(layers):
            for head in range(attention.num_heads):
                with ablated(model, {layer: [head]}, part="cross"):
                    ablated_loss[layer, head] = float(_loss(model, probe))
    return {"loss": loss, "ablated_loss": ablated_loss}


@dataclass
class ReverseRun:
    """A finished reverse run: its settings, the trained model (eval mode), the history of its logs (loss,
    tokens/s and :func:`probe_scores` at every log) and ``final``: the last probe with :func:`ablation_scores`
    and ``exact_match``."""

    settings: ReverseSettings
    model: Seq2Seq
    history: History
    final: dict[str, Any]

    def behaviours(self) -> dict[str, torch.Tensor]:
        """The probe measures the roles weigh, (decoder_layers, h) over the cross-attention heads."""
        return {"alignment": self.final["alignment"]}

    def save(self, folder: str | Path) -> Written:
        """Write the run into ``folder``: ``model/`` (the seq2seq model, its symbols and its cross-attention
        behaviours: open it with :func:`multihead.lab.models.seq2seq_reader.load_seq2seq_reader`), ``log.json``
        (settings, history, final scores) and ``curves.png`` (left out without
        matplotlib: in the result's ``skipped``). Returns {what: path}."""
        out = output_folder("folder", folder)
        model_dir = out / "model"
        with writing("folder", model_dir):
            self.model.save(model_dir)
            SymbolTokenizer(task_symbols(self.settings.vocab_size), max_length=1).save(model_dir)
            write_behaviours(model_dir, self.behaviours(), task="reverse", part="cross", settings=self.settings)
        meta = {"task": "reverse", "settings": dataclasses.asdict(self.settings), "final": plain_measures(self.final)}
        log = Path(history_to_json(self.history, out / "log.json", meta=meta))
        written = Written(model=model_dir, log=log)
        keys = ["probe_loss", "accuracy", "alignment"]
        draw_figure(written, "curves", out / "curves.png", lambda path: plot_history(self.history, path, keys=keys))
        return written


def run_reverse(
    settings: ReverseSettings = ReverseSettings(),
    *,
    on_log: Callable[[int, Mapping[str, Any]], None] | None = None,
    model: Seq2Seq | None = None,
) -> ReverseRun:
    """Train an encoder-decoder on the reverse task with ``settings`` and measure its cross-attention heads
    (see the module docstring).

    ``on_log(step, scores)``: called at every log with the probe's scores (a progress bar goes here).
    ``model``: train this Seq2Seq instead of a new one (it must read the task: its vocab_size and
    max_positions); the settings' model fields are then not used.
    """
    if not isinstance(settings, ReverseSettings):
        raise bad_argument(
            "settings", "ReverseSettings", describe(settings), "pass ReverseSettings(...)", kind=TypeError
        )
    if model is None:
        torch.manual_seed(settings.seed)  # the initialisation, reproducible from the seed
        model = Seq2Seq(settings.model_config(), name="reverse")
    elif not isinstance(model, Seq2Seq):
        raise bad_argument("model", "a Seq2Seq", describe(model), "pass a multihead.lab.models.Seq2Seq", kind=TypeError)
    device = model.token_embeddings.weight.device
    probe = probe_batch(settings, device)

    def make_batch(generator: torch.Generator) -> ReverseBatch:
        return reverse_batch(settings.batch, settings.length, settings.vocab_size, generator=generator)

    history = train_run(
        model, settings, make_batch, _loss, lambda: probe_scores(model, probe), on_log, count_tokens=_count_tokens
    )
    final = {**probe_scores(model, probe), **ablation_scores(model, probe), "exact_match": exact_match(model, probe)}
    return ReverseRun(settings, model.eval(), history, final)

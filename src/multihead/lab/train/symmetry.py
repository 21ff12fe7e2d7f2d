"""Why the heads of a layer do not all learn the same thing: their random initialisation breaks the symmetry.

    layer = model.attention_layers[0]
    make_heads_identical(layer)                  # every head a copy of head 0 (W^Q, W^K, W^V rows, W^O columns)
    heads_divergence(model, ids, layer=0)        # (h, h) mean JSD in bits between the heads' attention rows
    result = symmetry_experiment(steps=300, seed=0)
    result["identical"]["history"][-1]["divergence_mean"]   # [0.0, 0.0]: still one head, h times over
    run = run_symmetry(InductionSettings(steps=300))         # the same, with an induction run's settings
    run.save("multihead-train")                              # symmetry.json (run.result) and symmetry.png

A layer whose heads start identical stays identical under gradient descent: the heads read the same input
(the layer norm's output), hold the same parameters, and their outputs enter the rest of the network
symmetrically (the same W^O columns), so each receives the same gradient, and AdamW, elementwise, makes the
same update. Nothing in the model can tell them apart, so nothing can make them differ: h heads do the work of
one. A random initialisation is what breaks the tie, after which each head follows its own gradient and they
specialise. :func:`symmetry_experiment` trains the same model both ways and logs the heads' pairwise
divergence (the measure of :mod:`multihead.lab.inspect.similarity`) over training.

Floating point. The argument is exact in real arithmetic; in floating point the heads stay bitwise identical
only if every kernel rounds each head's slice of a tensor the same way. A GEMM whose output columns are heads
(W^O's input gradient ``dL/dout W^O`` and its weight gradient ``dL/dout^T O``, both (., h*e)) computes the
columns in tiles, and a remainder tile may sum in another order. Measured with torch 2.13 (CPU, MKL, AVX2, one
thread): float64 matrix products round the last ``N mod 12`` columns differently from the rest, so with
h*e = 64 head 3's last 4 columns get gradients ~1 ulp off and the heads drift apart by ~1e-14 in 20 steps
(h*e = 48 or 96: bitwise identical); float32 products showed no such remainder, but torch's SDPA CPU backward
gives per-head dq/dk/dv differing by ~1 ulp at head_dim = 10 (bitwise identical at 12 and 16). Such a rounding
difference does not stay small: in the float64 h*e = 64 run of :func:`symmetry_experiment`, head 3 (the one in
the remainder columns) drifts from the others by 1e-14 at step 100 and by 1e-4 at step 1000 in layer 1, about
10x per 100 steps after step 300, while heads 0-2 stay bitwise equal. The identical point is unstable: any
asymmetry, even rounding, grows under training, which is why a random initialisation breaks the tie so well.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from multihead._errors import bad_argument, describe, floating_dtype, positive_int
from multihead._figures import Written, draw_figure, pyplot, save_figure
from multihead._userfiles import output_file, output_folder, writing
from multihead.capture import attention_layers, capture
from multihead.lab.inspect.similarity import DivergenceAccumulator
from multihead.lab.models.contract import evaluating
from multihead.lab.models.decoder import Decoder, DecoderConfig
from multihead.lab.models.tasks import induction_batch
from multihead.lab.train.induction import InductionSettings
from multihead.lab.train.loop import train
from multihead.lab.train.scores import induction_score, per_position_loss, repeated_half_loss
from multihead.layer import MultiHeadAttention

__all__ = [
    "make_heads_identical",
    "head_parameter_difference",
    "heads_divergence",
    "symmetry_experiment",
    "plot_symmetry",
    "SymmetryRun",
    "run_symmetry",
]


def _check_layer(layer: object) -> MultiHeadAttention:
    if not isinstance(layer, MultiHeadAttention):
        raise bad_argument(
            "layer",
            "a multihead.MultiHeadAttention",
            describe(layer),
            "pass e.g. model.attention_layers[0]",
            kind=TypeError,
        )
    return layer


def _check_source(layer: MultiHeadAttention, source_head: object) -> int:
    if not isinstance(source_head, int) or isinstance(source_head, bool):
        raise bad_argument(
            "source_head", "a head index (int)", describe(source_head), "pass e.g. source_head=0", kind=TypeError
        )
    if not 0 <= source_head < layer.num_heads:
        raise bad_argument(
            "source_head",
            f"a head index in 0..{layer.num_heads - 1} (the layer has {layer.num_heads} heads)",
            source_head,
            f"pass source_head in 0..{layer.num_heads - 1}",
        )
    return source_head


def _head_blocks(layer: MultiHeadAttention, source_head: int) -> list[tuple[str, torch.Tensor, int]]:
    """Each per-head parameter of ``layer`` as (name, view with the head axis first, the source's index on it).

    The layout (see :class:`multihead.MultiHeadAttention`): W^Q (h*d, embed_dim) holds query head n in rows
    n*d .. (n+1)*d - 1; W^K (g*d, kdim) and W^V (g*e, vdim) hold key/value head m in rows m*d.. and m*e..; W^O
    (out_dim, h*e) reads head n's output in columns n*e .. (n+1)*e - 1. Query head n reads key/value head
    n // (h/g) (GQA), so the source's key/value head is source_head // (h/g). W^O's bias is shared by the heads.
    """
    h, g, d, e = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.value_head_dim
    kv_source = source_head // (h // g)
    blocks = [
        ("q_proj.weight", layer.q_proj.weight.view(h, d, layer.embed_dim), source_head),  # (h, d, embed_dim)
        ("k_proj.weight", layer.k_proj.weight.view(g, d, layer.kdim), kv_source),  # (g, d, kdim)
        ("v_proj.weight", layer.v_proj.weight.view(g, e, layer.vdim), kv_source),  # (g, e, vdim)
        ("out_proj.weight", layer.out_proj.weight.view(layer.out_dim, h, e).transpose(0, 1), source_head),  # (h, o, e)
    ]
    if layer.q_proj.bias is not None:
        blocks += [
            ("q_proj.bias", layer.q_proj.bias.view(h, d), source_head),  # (h, d)
            ("k_proj.bias", layer.k_proj.bias.view(g, d), kv_source),  # (g, d)
            ("v_proj.bias", layer.v_proj.bias.view(g, e), kv_source),  # (g, e)
        ]
    return blocks


def make_heads_identical(layer: MultiHeadAttention, source_head: int = 0) -> None:
    """Copy head ``source_head``'s parameters into every other head of ``layer``, in place.

    Copied: the source's W^Q rows and bias, its key/value head's W^K and W^V rows and biases (under GQA every
    key/value head becomes the one the source query head reads, ``source_head // (h/g)``, and every query head
    the source query head), and its W^O input columns. W^O's bias is shared and left alone; the layer's output
    shape does not change (its values do).

    Why identical heads stay identical in training: each head computes ``softmax(x W_n^Q (x W_n^K)^T) x W_n^V``
    from the same input x, so identical parameters give identical outputs o_n; the layer returns
    ``sum_n o_n W_n^O``, so with identical W^O columns the loss is a symmetric function of the heads, and the
    gradients ``dL/dW_n^O = dL/dout^T o_n`` and ``dL/do_n = dL/dout W_n^O`` (hence those of W_n^Q, W_n^K, W_n^V)
    are identical too. Gradient clipping scales every gradient by one number and AdamW's update is elementwise,
    so the step keeps the heads identical, step after step. The W^O columns matter: heads with identical
    W^Q/W^K/W^V but different W^O columns attend alike at first but get different gradients and drift apart.

    What breaks the symmetry: dropout on the attention weights (``dropout > 0`` draws a different mask for each
    head), a ``head_gate`` or head ablation that treats heads differently, or anything else per head. Rotary
    positions do not: the same rotation (by position, over head_dim) is applied to every head's q and k.

    Bit for bit, the symmetry holds only if every kernel rounds each head's slice the same way, which kernels
    that tile a head axis do not promise (see the module's note on floating point).

    Args:
        layer: a :class:`multihead.MultiHeadAttention` (e.g. ``model.attention_layers[l]``).
        source_head: the query head to copy, 0..h-1.

    Raises:
        TypeError naming ``layer`` or ``source_head``; ValueError naming ``source_head`` with the valid range.
        The layer is left unchanged when it raises.
    """
    layer = _check_layer(layer)
    source_head = _check_source(layer, source_head)
    with torch.no_grad():
        for _, heads, source in _head_blocks(layer, source_head):
            value = heads[source].clone()  # cloned: the source is one of the heads being written
            heads.copy_(value.expand_as(heads))


def head_parameter_difference(layer: MultiHeadAttention, source_head: int = 0) -> float:
    """The largest absolute difference between any head's parameters and head ``source_head``'s (W^Q rows and
    bias, the key/value head's W^K/W^V rows and biases, W^O columns, laid out as :func:`make_heads_identical`
    reads them). 0.0 exactly when every head is a bitwise copy of the source."""
    layer = _check_layer(layer)
    source_head = _check_source(layer, source_head)
    largest = 0.0
    with torch.no_grad():
        for _, heads, source in _head_blocks(layer, source_head):
            largest = max(largest, float((heads - heads[source]).abs().max()))
    return largest


def _check_ids(batch_ids: object) -> torch.Tensor:
    if (
        not isinstance(batch_ids, torch.Tensor)
        or batch_ids.ndim != 2
        or batch_ids.dtype not in (torch.int32, torch.int64)
    ):
        raise bad_argument(
            "batch_ids",
            "an integer tensor (b, n) of token ids",
            describe(batch_ids),
            "pass e.g. induction_batch(...).ids",
            kind=TypeError,
        )
    return batch_ids


def _layer_indices(name: str, layers: object, count: int) -> list[int]:
    values = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise bad_argument(
            name, "a layer index or a list of them (int)", describe(layers), f"pass e.g. {name}=[0]", kind=TypeError
        )
    for value in values:
        if not 0 <= value < count:
            raise bad_argument(
                name, f"layer indices in 0..{count - 1} (the model has {count} layers)", value, f"pass {name} < {count}"
            )
    return sorted(set(values))


def _forward(model: nn.Module, ids: torch.Tensor, layers: list[int]) -> tuple[Any, dict[int, torch.Tensor]]:
    """One forward pass of ``ids`` (b, n) in eval mode without autograd: the model's output and
    {layer: attention weights (b, h, i, j)}."""
    with evaluating(model), capture(model, layers=layers) as rec:
        output = model(ids)
    return output, {layer: rec.weights(layer) for layer in layers}


def _divergence(weights: torch.Tensor) -> torch.Tensor:
    """(b, h, i, j) attention weights -> (h, h) mean JSD in bits over every query row (no padding here)."""
    b, h, i, j = weights.shape
    accumulator = DivergenceAccumulator(h)
    real_queries = torch.ones(b, i, dtype=torch.bool, device=weights.device)  # (b, i)
    real_keys = torch.ones(b, j, dtype=torch.bool, device=weights.device)  # (b, j)
    accumulator.add(weights, real_queries, real_keys)
    return accumulator.result()


def heads_divergence(model: nn.Module, batch_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The heads' pairwise divergence in ``layer``: the Jensen-Shannon divergence between two heads' attention
    rows, in bits, averaged over every query position of ``batch_ids`` (the measure of the report's similarity
    view, :class:`multihead.lab.inspect.similarity.DivergenceAccumulator`).

    Causal rows: a query's weights on the keys it cannot see are exactly 0 in every head and add nothing
    (0 log 0 = 0), so each row is compared over the keys that query sees. The first query sees one key and
    counts 0 for every pair, as in the report.

    Args:
        model: a model built on :class:`multihead.MultiHeadAttention` that maps ids (b, n) to its output (a
            :class:`multihead.lab.models.Decoder`); run in eval mode without autograd (its mode comes back).
        batch_ids: (b, n) int token ids.
        layer: the attention layer, 0..layers-1.

    Returns:
        (h, h) float64, symmetric, 0 on the diagonal: 0 = the two heads attend identically, 1 = disjointly.
    """
    count = len(attention_layers(model))
    ids = _check_ids(batch_ids)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise bad_argument("layer", "one layer index (int)", describe(layer), "pass e.g. layer=0", kind=TypeError)
    _layer_indices("layer", layer, count)
    _, weights = _forward(model, ids, [layer])
    return _divergence(weights[layer])


def _off_diagonal(divergence: torch.Tensor) -> torch.Tensor:
    """(h, h) -> (h (h - 1),): every ordered pair of distinct heads (empty for one head)."""
    h = divergence.shape[0]
    return divergence[~torch.eye(h, dtype=torch.bool)]


def _measure(model: Decoder, ids: torch.Tensor, half_length: int, identical: list[int] | None) -> dict[str, Any]:
    """Per layer: the mean and min off-diagonal divergence and the heads' induction scores; the repeated half's
    loss; for the identical run, per identical layer the largest parameter difference between heads."""
    layers = list(range(len(model.attention_layers)))
    logits, weights = _forward(model, ids, layers)
    pairs = [_off_diagonal(_divergence(weights[n])) for n in layers]
    entry: dict[str, Any] = {
        "divergence_mean": [float(p.mean()) if p.numel() else 0.0 for p in pairs],
        "divergence_min": [float(p.min()) if p.numel() else 0.0 for p in pairs],
        "induction": [induction_score(weights[n], half_length).tolist() for n in layers],
        "repeated_loss": float(repeated_half_loss(logits, ids, half_length).mean()),
    }
    if identical is not None:
        entry["head_difference"] = [head_parameter_difference(model.attention_layers[n]) for n in identical]
    return entry


def _checked_config(config: object, vocab_size: int | None) -> DecoderConfig:
    """``config``, or for None the experiment's default decoder: 2 attention-only layers of 4 heads, hidden 64,
    vocabulary ``vocab_size`` or 32."""
    if config is None:
        config = DecoderConfig(
            vocab_size=32 if vocab_size is None else vocab_size, hidden=64, layers=2, heads=4, mlp=None
        )
    if not isinstance(config, DecoderConfig):
        raise bad_argument(
            "config", "a DecoderConfig or None", describe(config), "pass DecoderConfig(...)", kind=TypeError
        )
    return config


def _checked_vocab_size(vocab_size: int | None, config: DecoderConfig) -> int:
    """The tokens the task draws: ``vocab_size`` (None: the config's), which the decoder must be able to embed."""
    if vocab_size is None:
        vocab_size = config.vocab_size
    vocab_size = positive_int("vocab_size", vocab_size)
    if vocab_size > config.vocab_size:
        raise bad_argument(
            "vocab_size",
            f"at most config.vocab_size = {config.vocab_size}",
            vocab_size,
            "pass a smaller vocab_size, or a config with a larger vocabulary",
        )
    return vocab_size


def _checked_half_length(half_length: int, config: DecoderConfig) -> int:
    """The task's L, whose sequences of 2L + 1 tokens must fit the decoder's learned positions (if it has them)."""
    half_length = positive_int("half_length", half_length)
    if config.positions == "learned" and 2 * half_length + 1 > config.max_positions:
        raise bad_argument(
            "half_length",
            f"2 * half_length + 1 <= config.max_positions = {config.max_positions} (learned positions)",
            half_length,
            "pass a smaller half_length",
        )
    return half_length


def _random_and_identical_models(
    config: DecoderConfig, dtype: torch.dtype, seed: int, identical: list[int]
) -> tuple[Decoder, Decoder]:
    """One decoder drawn from ``seed`` (torch's global generator put back afterwards) and a copy of it whose
    ``identical`` layers have every head made a copy of head 0: the two runs start from the same parameters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random_model = Decoder(config).to(dtype)
    identical_model = copy.deepcopy(random_model)
    for index in identical:
        make_heads_identical(identical_model.attention_layers[index])
    return random_model, identical_model


def _train_logging_divergence(
    model: Decoder,
    measured: list[int] | None,
    evaluation_ids: torch.Tensor,
    *,
    half_length: int,
    make_batch: Callable[[torch.Generator], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    steps: int,
    lr: float,
    seed: int,
    log_every: int,
) -> dict[str, Any]:
    """One run of :func:`symmetry_experiment`: train ``model`` in place, measuring :func:`_measure` on
    ``evaluation_ids`` (b, 2L + 1) before any update and at every log. ``measured``: the layers whose heads'
    parameter difference is logged (None: none, the random run). Returns ``{"history": [logs]}``."""

    def on_log(model: nn.Module, step: int) -> dict[str, Any]:
        return _measure(cast(Decoder, model), evaluation_ids, half_length, measured)

    first = {"step": 0, "loss": None, "tokens_per_s": None, **on_log(model, 0)}  # before any update
    history = train(
        model, make_batch, steps=steps, lr=lr, seed=seed, loss_fn=loss_fn, log_every=log_every, on_log=on_log
    )
    return {"history": [first, *history]}


def symmetry_experiment(
    config: DecoderConfig | None = None,
    *,
    steps: int = 300,
    seed: int = 0,
    identical_layers: Sequence[int] | None = None,
    half_length: int = 8,
    min_half_length: int | None = 4,
    vocab_size: int | None = None,
    batch: int = 16,
    lr: float = 3e-3,
    log_every: int = 25,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Train one :class:`~multihead.lab.models.Decoder` on the induction task twice from the same initialisation:
    once as drawn ("random"), once with :func:`make_heads_identical` applied to ``identical_layers``
    ("identical"); same batches, same seed. Log the heads' pairwise divergence over training.

    Args:
        config: the decoder (default: 2 attention-only layers of 4 heads, hidden 64, rotary, vocabulary
            ``vocab_size`` or 32).
        steps: AdamW updates per run.
        seed: seeds the initialisation, the batches and the evaluation batch.
        identical_layers: the layers whose heads start identical in the second run (default: every layer).
        half_length: L of the induction task (sequences of 2L + 1 tokens).
        min_half_length: training repeats segments of 2..L tokens from here (None: always L); see
            :func:`multihead.lab.train.induction_batch`. The measurements use a fixed batch of L.
        vocab_size: tokens drawn by the task, at most ``config.vocab_size`` (default: the config's).
        batch: sequences per update (and in the evaluation batch).
        lr: AdamW's learning rate.
        log_every: measure every this many updates (and at step 0 and the last).
        dtype: the models' parameter dtype (float32 or float64).

    Returns:
        A JSON-ready dict: the settings, and for "random" and "identical" a ``history`` of logs, each
        ``{"step", "loss", "tokens_per_s", "divergence_mean": [per layer], "divergence_min": [per layer],
        "induction": [per layer [per head]], "repeated_loss"}``, the first at step 0 (before any update: loss and
        tokens_per_s None); the identical run's logs add ``head_difference``, per identical layer the largest
        absolute difference between a head's parameters and head 0's. ``identical_stayed_identical``: every
        identical layer's heads were bitwise equal at every log.
    """
    config = _checked_config(config, vocab_size)
    dtype = floating_dtype("dtype", dtype, allow_none=False)
    vocab_size = _checked_vocab_size(vocab_size, config)
    half_length = _checked_half_length(half_length, config)
    batch = positive_int("batch", batch)
    log_every = positive_int("log_every", log_every)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad_argument("seed", "an int", describe(seed), "pass seed=0", kind=TypeError)
    layers = list(range(config.layers)) if identical_layers is None else list(identical_layers)
    identical = _layer_indices("identical_layers", layers, config.layers)
    # the task's own checks (half_length >= 2, min_half_length in 2..L, vocab_size) before anything is built
    induction_batch(1, half_length, vocab_size, generator=torch.Generator(), min_half_length=min_half_length)
    evaluation = induction_batch(batch, half_length, vocab_size, generator=torch.Generator().manual_seed(seed + 1))
    random_model, identical_model = _random_and_identical_models(config, dtype, seed, identical)

    def make_batch(generator: torch.Generator):
        return induction_batch(batch, half_length, vocab_size, generator=generator, min_half_length=min_half_length)

    def loss_fn(model: nn.Module, task) -> torch.Tensor:
        return per_position_loss(model(task.ids), task.ids).mean()

    runs: dict[str, Any] = {}
    for name, model, measured in (("random", random_model, None), ("identical", identical_model, identical)):
        runs[name] = _train_logging_divergence(
            model,
            measured,
            evaluation.ids,
            half_length=half_length,
            make_batch=make_batch,
            loss_fn=loss_fn,
            steps=steps,
            lr=lr,
            seed=seed,
            log_every=log_every,
        )
    identical_history = runs["identical"]["history"]
    return {
        "config": dataclasses.asdict(config),
        "steps": steps,
        "seed": seed,
        "identical_layers": identical,
        "half_length": half_length,
        "min_half_length": min_half_length,
        "vocab_size": vocab_size,
        "batch": batch,
        "lr": lr,
        "dtype": str(dtype).removeprefix("torch."),
        "random": runs["random"],
        "identical": runs["identical"],
        "identical_stayed_identical": all(
            difference == 0.0 for entry in identical_history for difference in entry["head_difference"]
        ),
    }


def plot_symmetry(result: dict[str, Any], path: str | os.PathLike) -> str:
    """Draw a :func:`symmetry_experiment` result into a PNG at ``path``: per layer, the heads' mean pairwise
    divergence over training for the random (solid) and identical (dashed) runs, and both runs' repeated-half
    loss. Returns the path written. Needs matplotlib."""
    if not isinstance(result, dict) or not all(name in result for name in ("random", "identical")):
        raise bad_argument(
            "result", "a symmetry_experiment result", describe(result), "pass symmetry_experiment(...)'s result"
        )
    target = output_file("path", path, suffixes=(".png",), fix="pass a path ending in .png in a writable folder")
    plt = pyplot("plot_symmetry")
    figure, (divergence, loss) = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True)
    for name, style in (("random", "-"), ("identical", "--")):
        history = result[name]["history"]
        steps = [entry["step"] for entry in history]
        for layer, curve in enumerate(zip(*(entry["divergence_mean"] for entry in history), strict=True)):
            divergence.plot(steps, curve, style, color=f"C{layer}", label=f"{name} heads, layer {layer}")
        loss.plot(steps, [entry["repeated_loss"] for entry in history], style, color="k", label=f"{name} heads")
    divergence.set_ylabel("mean pairwise JSD (bits)")
    divergence.legend(fontsize=7)
    divergence.grid(alpha=0.3)
    loss.set_ylabel("repeated-half loss")
    loss.set_xlabel("step")
    loss.legend(fontsize=7)
    loss.grid(alpha=0.3)
    with writing("path", target):
        save_figure(figure, target)
    return str(target)


@dataclass(frozen=True)
class SymmetryRun:
    """A finished :func:`run_symmetry`: its ``settings`` and ``result``, the JSON-ready dict of
    :func:`symmetry_experiment` (the settings it ran with, and each run's ``history`` of divergences and losses)."""

    settings: InductionSettings
    result: dict[str, Any]

    @property
    def stayed_identical(self) -> bool:
        """Whether the heads that started identical were bitwise equal at every log (see the module's note on
        floating point)."""
        return bool(self.result["identical_stayed_identical"])

    def save(self, folder: str | os.PathLike[str]) -> Written:
        """Write the run into ``folder`` (created if missing): ``symmetry.json`` (:attr:`result`) and
        ``symmetry.png`` (:func:`plot_symmetry`; left out without matplotlib: in the result's ``skipped``).
        Returns {what: path}: "json" and "png". A folder that cannot be written raises ValueError naming
        ``folder``."""
        out = output_folder("folder", folder)
        written = Written(json=out / "symmetry.json")
        with writing("folder", written["json"]):
            written["json"].write_text(json.dumps(self.result, indent=1))
        draw_figure(written, "png", out / "symmetry.png", lambda path: plot_symmetry(self.result, path))
        return written


def run_symmetry(
    settings: InductionSettings | None = None,
    *,
    identical_layers: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> SymmetryRun:
    """:func:`symmetry_experiment` on the decoder and task of an induction run's ``settings`` (what
    ``multihead train symmetry`` runs).

    The decoder of ``settings.model_config()`` is trained twice from one initialisation, as drawn and with the
    heads of ``identical_layers`` (default: every layer) made identical, for ``settings.steps`` AdamW updates of
    ``settings.batch`` sequences of the induction task (``half_length``, ``min_half_length``, ``vocab_size``), at
    ``settings.lr`` from ``settings.seed``, measured every ``settings.log_every`` updates. The settings' probe
    size and weight decay are not used.

    Args:
        settings: the run (None: ``InductionSettings()``: 2 layers of 4 heads, 3000 steps).
        identical_layers: the layers whose heads start identical in the second run (default: every layer).
        dtype: the models' parameter dtype (float32 or float64).

    Returns:
        A :class:`SymmetryRun`: ``result`` (the JSON-ready dict of :func:`symmetry_experiment`), and ``save(folder)``,
        which writes symmetry.json and symmetry.png.

    Raises:
        TypeError naming ``settings`` unless it is an :class:`~multihead.lab.train.InductionSettings`, and what
        :func:`symmetry_experiment` raises for ``identical_layers`` and ``dtype``, before any training.
    """
    if settings is None:
        settings = InductionSettings()
    if not isinstance(settings, InductionSettings):
        raise bad_argument(
            "settings", "InductionSettings or None", describe(settings), "pass InductionSettings(...)", kind=TypeError
        )
    result = symmetry_experiment(
        settings.model_config(),
        steps=settings.steps,
        seed=settings.seed,
        identical_layers=identical_layers,
        half_length=settings.half_length,
        min_half_length=settings.min_half_length,
        vocab_size=settings.vocab_size,
        batch=settings.batch,
        lr=settings.lr,
        log_every=settings.log_every,
        dtype=dtype,
    )
    return SymmetryRun(settings=settings, result=result)

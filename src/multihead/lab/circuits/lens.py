"""Reading the residual stream through the unembedding: direct logit attribution per head and per layer, and the
logit lens.

    found = direct_logit_attribution(model, ids, answer=12, wrong=40)
    found.heads          # (layers, heads): each head's direct effect on logit(answer) - logit(wrong)
    lens = logit_lens(model, ids, answer=12, wrong=40)
    lens.differences     # (layers + 1,): the logit difference read after the embedding and after each layer

A head's direct effect is its output at the last position, z_h W_O,h (its columns of W^O), through the final norm
linearised at the model's own final residual — as TransformerLens does (``apply_ln_to_stack``): the centring of
a LayerNorm applies to each part, the scale is the final residual's, frozen — and through the unembedding. It
leaves out everything the head does through later layers. The logit lens reads the residual after each layer
through the final norm itself (each residual normalised by its own scale) and the unembedding.

Which modules hold the blocks, the final norm, the unembedding and each layer's W^O is found by
:func:`lens_parts`: a :class:`~multihead.lab.models.Decoder`, or a transformers causal LM (GPT-2, GPT-NeoX, Llama,
Mistral, Qwen2, Gemma 2 ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.attend import AttentionSite
from multihead.capture import part_sites
from multihead.lab.circuits._runs import checked_ids, checked_tokens, logits_of
from multihead.lab.models.contract import evaluating

__all__ = ["LensParts", "lens_parts", "LogitAttribution", "direct_logit_attribution", "LogitLens", "logit_lens"]

# where a transformers causal LM keeps its parts, by the attribute names its architectures use
_BLOCK_LISTS = ("h", "layers", "blocks")
_FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "final_norm")
_OUT_PROJECTIONS = ("out_proj", "o_proj", "c_proj", "dense")


@dataclass(frozen=True)
class LensParts:
    """The parts of a causal LM the lens tools read: ``blocks`` (the residual after block l is its output, or its
    output's first element), ``final_norm``, ``unembedding`` ((vocab, hidden) weight and (vocab,) bias or None),
    ``sites`` (the attention steps, layer order) and ``out_projections``: each layer's W^O as (weight
    (hidden, h e), bias (hidden,) or None) in ``F.linear``'s convention."""

    blocks: list[nn.Module]
    final_norm: nn.Module
    unembedding: tuple[torch.Tensor, torch.Tensor | None]
    sites: list[AttentionSite]
    out_projections: list[tuple[torch.Tensor, torch.Tensor | None]]


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The first of ``names`` that is a submodule of ``module``."""
    return next((getattr(module, name) for name in names if isinstance(getattr(module, name, None), nn.Module)), None)


def _as_linear(projection: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (out, in), bias) of a Linear, or of transformers' Conv1D (GPT-2), which stores (in, out)."""
    if isinstance(projection, nn.Linear):
        return projection.weight, projection.bias
    weight = getattr(projection, "weight", None)
    if type(projection).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        return weight.T, getattr(projection, "bias", None)
    raise TypeError(type(projection).__name__)


def lens_parts(model: nn.Module) -> LensParts:
    """Find ``model``'s blocks, final norm, unembedding and W^O of each layer (see the module docstring).

    Raises TypeError naming ``model`` when it is neither a Decoder nor a transformers causal LM of a known layout.
    """
    _, sites = part_sites(model, None)
    fix = "pass a multihead.lab.models.Decoder or a transformers *ForCausalLM on the kernel"
    # our Decoder keeps its parts under its own names; a transformers model under its base model's
    base = model if isinstance(getattr(model, "final_norm", None), nn.Module) else getattr(model, "base_model", None)
    found = _child(base, _BLOCK_LISTS) if isinstance(base, nn.Module) else None
    blocks = list(found) if isinstance(found, nn.ModuleList) else []
    final_norm = _child(base, _FINAL_NORMS) if isinstance(base, nn.Module) else None
    if base is model:  # the Decoder: its own head, or the token embeddings it ties to
        head = _child(model, ("lm_head", "token_embeddings"))
    else:
        output_embeddings = getattr(model, "get_output_embeddings", None)
        head = output_embeddings() if callable(output_embeddings) else None
    weight = getattr(head, "weight", None)
    if not blocks or final_norm is None or not isinstance(weight, torch.Tensor):
        raise bad_argument(
            "model",
            "a causal LM with blocks, a final norm and an unembedding this tool knows where to find",
            f"a {type(model).__name__}",
            fix,
            kind=TypeError,
        )
    if len(blocks) != len(sites):
        raise bad_argument("model", "one attention step per block", f"{len(sites)} in {len(blocks)} blocks", fix)
    bias = getattr(head, "bias", None)
    unembedding = (weight, bias if isinstance(bias, torch.Tensor) else None)
    projections = []
    for site in sites:
        attention_module = model.get_submodule(site.name) if site.name else None
        projection = None if attention_module is None else _child(attention_module, _OUT_PROJECTIONS)
        try:
            projections.append(_as_linear(projection))
        except TypeError:
            raise bad_argument(
                "model",
                "attention modules with an output projection W^O (a Linear or Conv1D)",
                f"{site.name or type(model).__name__}: {describe(projection)}",
                fix,
                kind=TypeError,
            ) from None
    return LensParts(blocks, final_norm, unembedding, list(sites), projections)


def _linearised_norm(
    norm: nn.Module, residual: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """The final norm as a linear map frozen at ``residual`` (…, hidden), and the constant it adds (its bias):
    LayerNorm (centre, divide by the residual's scale, times its weight) or an RMS norm (divide by the root mean
    square, times its weight, or 1 + weight for Gemma's). Checked: the map of the residual plus the constant is
    the norm's own output."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    name = type(norm).__name__
    if isinstance(norm, nn.LayerNorm) or name.endswith("LayerNorm"):
        scale = (residual.var(-1, unbiased=False, keepdim=True) + float(eps or 0.0)).sqrt()

        def apply(part: torch.Tensor) -> torch.Tensor:
            centred = part - part.mean(-1, keepdim=True)
            return centred / scale * (1.0 if weight is None else weight)

        bias = getattr(norm, "bias", None)
        constant = torch.zeros_like(residual) if bias is None else bias.expand_as(residual)
    elif "RMSNorm" in name and isinstance(weight, torch.Tensor):
        scale = (residual.float().pow(2).mean(-1, keepdim=True) + float(eps or 0.0)).sqrt().to(residual.dtype)
        gain = 1.0 + weight if name.startswith("Gemma") else weight

        def apply(part: torch.Tensor) -> torch.Tensor:
            return part / scale * gain

        constant = torch.zeros_like(residual)
    else:
        raise bad_argument(
            "model",
            "a final LayerNorm or RMS norm (what direct logit attribution linearises)",
            name,
            "use logit_lens, which applies the norm itself",
            kind=TypeError,
        )
    expected = norm(residual)
    if not torch.allclose(apply(residual) + constant, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max())):
        raise bad_argument(
            "model",
            "a final norm its linearisation reproduces (LayerNorm, or an RMS norm scaling by weight)",
            f"{name}, whose output differs from the linearised one",
            "use logit_lens, which applies the norm itself",
            kind=TypeError,
        )
    return apply, constant


@dataclass(frozen=True)
class LogitAttribution:
    """Direct logit attribution at one position, averaged over the prompts: ``heads`` (layers, heads) and
    ``layers`` (layers,), each attention layer's output (its heads and W^O's bias); ``difference``: the model's
    logit difference there, and ``explained``: what the parts of the residual stream sum to through the
    linearised norm (every block and the embedding; equal to ``difference`` up to rounding)."""

    heads: torch.Tensor
    layers: torch.Tensor
    difference: float
    explained: float

    def to_dict(self) -> dict:
        return {
            "heads": self.heads.tolist(),
            "layers": self.layers.tolist(),
            "logit_difference": self.difference,
            "explained": self.explained,
        }


def _residuals(model: nn.Module, parts: LensParts, ids: torch.Tensor, outputs: bool):
    """Run ``model`` recording the residual before block 0 and after every block ((layers + 1) tensors (b, n,
    hidden)) and, with ``outputs``, every attention step's per-head outputs z (b, h, n, e)."""
    residuals: dict[int, torch.Tensor] = {}
    heads: dict[int, torch.Tensor] = {}

    def before(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        residuals[-1] = hidden.detach()

    def after(layer):
        def hook(module, args, result):
            residuals[layer] = (result[0] if isinstance(result, tuple) else result).detach()

        return hook

    def step(layer):
        def hook(module, args, kwargs, result):
            heads[layer] = result.output.detach()

        return hook

    handles = [parts.blocks[0].register_forward_pre_hook(before, with_kwargs=True)]
    handles += [block.register_forward_hook(after(layer)) for layer, block in enumerate(parts.blocks)]
    if outputs:
        handles += [
            site.attend.register_forward_hook(step(layer), with_kwargs=True) for layer, site in enumerate(parts.sites)
        ]
    try:
        logits = logits_of(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    stack = [residuals[layer] for layer in range(-1, len(parts.blocks))]
    return logits, stack, heads


def direct_logit_attribution(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    answer: int | torch.Tensor,
    wrong: int | torch.Tensor,
    position: int = -1,
) -> LogitAttribution:
    """Each head's and each attention layer's direct effect on logit(answer) - logit(wrong) at ``position`` (default
    the last), averaged over the prompts ``ids`` (n,) or (b, n): see the module docstring.

    Raises TypeError naming ``model`` for a model whose parts or final norm it cannot read, ValueError or TypeError
    naming ``ids``, ``answer``, ``wrong`` or ``position``.
    """
    ids = checked_ids("ids", ids, "tokenise the prompt")
    if not isinstance(position, int) or isinstance(position, bool) or not -ids.shape[1] <= position < ids.shape[1]:
        raise bad_argument(
            "position", f"a position in [-{ids.shape[1]}, {ids.shape[1]})", describe(position), "pass -1"
        )
    parts = lens_parts(model)
    with evaluating(model):
        logits, residuals, heads = _residuals(model, parts, ids, outputs=True)
    weight, unembed_bias = parts.unembedding
    answer = checked_tokens("answer", answer, ids.shape[0], weight.shape[0], weight.device)
    wrong = checked_tokens("wrong", wrong, ids.shape[0], weight.shape[0], weight.device)
    direction = (weight[answer] - weight[wrong]).to(residuals[-1].dtype)  # (b, hidden)
    final = residuals[-1][:, position]  # (b, hidden)
    with torch.no_grad():
        apply, constant = _linearised_norm(parts.final_norm, final)

        def read(part: torch.Tensor) -> torch.Tensor:  # (b, hidden) -> (b,) its share of the logit difference
            return (apply(part) * direction).sum(-1)

        head_scores, layer_scores = [], []
        for layer, (w_o, b_o) in enumerate(parts.out_projections):
            z = heads[layer][:, :, position]  # (b, h, e)
            h, e = z.shape[1], z.shape[2]
            per_head = torch.einsum("bhe,dhe->bhd", z, w_o.reshape(w_o.shape[0], h, e).to(z.dtype))  # (b, h, hidden)
            shares = torch.stack([read(per_head[:, head]) for head in range(h)], dim=1)  # (b, h)
            head_scores.append(shares.mean(0))
            bias_share = read(b_o.to(z.dtype).expand_as(final)) if b_o is not None else torch.zeros_like(shares[:, 0])
            layer_scores.append((shares.sum(1) + bias_share).mean(0))
        # every part of the final residual: the embedding, then what each block added
        pieces = [residuals[0][:, position]] + [
            residuals[layer + 1][:, position] - residuals[layer][:, position] for layer in range(len(parts.blocks))
        ]
        explained = sum(read(piece) for piece in pieces) + (constant * direction).sum(-1)
        if unembed_bias is not None:
            explained = explained + (unembed_bias[answer] - unembed_bias[wrong]).to(explained.dtype)
    last = logits[:, position]
    rows = torch.arange(ids.shape[0], device=last.device)
    difference = float((last[rows, answer] - last[rows, wrong]).double().mean())
    return LogitAttribution(
        heads=_padded(head_scores),
        layers=torch.stack(layer_scores).cpu(),
        difference=difference,
        explained=float(explained.double().mean()),
    )


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of (possibly) different lengths as one (len(rows), longest) tensor, NaN past a row's end."""
    width = max(row.shape[0] for row in rows)
    out = torch.full((len(rows), width), float("nan"), dtype=rows[0].dtype)
    for index, row in enumerate(rows):
        out[index, : row.shape[0]] = row.cpu()
    return out


@dataclass(frozen=True)
class LogitLens:
    """The residual read through the final norm and unembedding after the embedding (row 0) and after each layer
    (row l + 1), at one position: ``logits`` (layers + 1, b, vocab); ``top`` (layers + 1, b, k) the k likeliest
    tokens; ``differences`` (layers + 1,) logit(answer) - logit(wrong) averaged over the prompts, when both
    were given (else None)."""

    logits: torch.Tensor
    top: torch.Tensor
    differences: torch.Tensor | None


def logit_lens(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    position: int = -1,
    top: int = 5,
    answer: int | torch.Tensor | None = None,
    wrong: int | torch.Tensor | None = None,
) -> LogitLens:
    """The logit lens at ``position`` (default the last) of ``ids`` (n,) or (b, n); its last row is the model's
    own logits. Raises as :func:`direct_logit_attribution`."""
    ids = checked_ids("ids", ids, "tokenise the prompt")
    if not isinstance(position, int) or isinstance(position, bool) or not -ids.shape[1] <= position < ids.shape[1]:
        raise bad_argument(
            "position", f"a position in [-{ids.shape[1]}, {ids.shape[1]})", describe(position), "pass -1"
        )
    if (answer is None) != (wrong is None):
        raise bad_argument("wrong", "given with answer, or neither", describe(wrong), "pass both answer= and wrong=")
    parts = lens_parts(model)
    weight, bias = parts.unembedding
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= weight.shape[0]:
        raise bad_argument("top", f"an int in [1, {weight.shape[0]}]", describe(top), "pass e.g. top=5")
    with evaluating(model):
        _, residuals, _ = _residuals(model, parts, ids, outputs=False)
        logits = torch.stack(
            [F.linear(parts.final_norm(resid[:, position]), weight, bias) for resid in residuals]
        )  # (layers + 1, b, vocab)
    differences = None
    if answer is not None and wrong is not None:
        answer_ids = checked_tokens("answer", answer, ids.shape[0], weight.shape[0], logits.device)
        wrong_ids = checked_tokens("wrong", wrong, ids.shape[0], weight.shape[0], logits.device)
        rows = torch.arange(ids.shape[0], device=logits.device)
        differences = (logits[:, rows, answer_ids] - logits[:, rows, wrong_ids]).mean(1).cpu()
    return LogitLens(logits=logits.cpu(), top=logits.topk(top, dim=-1).indices.cpu(), differences=differences)

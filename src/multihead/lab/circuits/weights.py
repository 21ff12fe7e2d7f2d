"""What the weights alone say about heads (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits"): each head's QK and OV circuits, their singular directions read through the embedding and the
unembedding, and how much the output of one head can feed another's query, key or value (composition scores).

    weights = head_weights(model)                  # W_Q, W_K, W_V (d_model, d_head), W_O (d_head, d_model) per head
    circuit = head_circuit(model, layer=1, head=2)  # QK and OV singular values; tokens along the top directions
    scores = composition_scores(model, "K")         # (layers, heads, layers, heads): earlier head -> later head

Matrices act on row vectors, as in TransformerLens: a head's QK circuit is W_Q W_K^T (the bilinear form its
scores take between a query position's residual and a key position's, before scaling, positions and norms),
its OV circuit W_V W_O (what it writes for what it reads). A composition score is ||L R||_F / (||L||_F ||R||_F)
with L the earlier head's OV and R the later head's QK (Q-composition), QK^T (K-composition) or OV
(V-composition). Both are low rank (d_head), and every norm here is taken in that factored form, never by
building a d_model x d_model product. The layer norms are left out (the weights as the model holds them, what
TransformerLens' bridge gives without its compatibility mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.lab.circuits.lens import LensParts, lens_parts
from multihead.lab.inspect.recording import head_numbers

__all__ = ["HeadWeights", "head_weights", "HeadCircuit", "head_circuit", "composition_scores", "COMPOSITIONS"]

COMPOSITIONS = ("Q", "K", "V")


@dataclass(frozen=True)
class HeadWeights:
    """Each head's projections, (layers, heads, ...), key/value heads repeated for the query heads they serve
    (GQA): ``W_Q``, ``W_K`` (d_model, d_head), ``W_V`` (d_model, d_head_v), ``W_O`` (d_head_v, d_model). The heads
    go by their checkpoint numbers: a head a pruned layer no longer has is NaN throughout."""

    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor


def _projections(module: nn.Module, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(W_q, W_k, W_v) of an attention module in F.linear's (out, in) convention, or None."""
    separate = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if all(isinstance(p, nn.Linear) for p in separate):
        return separate[0].weight, separate[1].weight, separate[2].weight  # type: ignore[union-attr]
    fused = getattr(module, "c_attn", None)  # GPT-2: one Conv1D (in, 3 out): q, k and v side by side
    weight = getattr(fused, "weight", None)
    if type(fused).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.shape == (hidden, 3 * hidden):
        q, k, v = weight.T.split(hidden, dim=0)
        return q, k, v
    return None


def head_weights(model: nn.Module) -> HeadWeights:
    """Every head's W_Q, W_K, W_V and W_O (see :class:`HeadWeights`), for a model
    :func:`~multihead.lab.circuits.lens_parts` reads whose attention has separate q/k/v projections (our layer,
    Llama, Mistral, Qwen2, Gemma ...) or GPT-2's fused one. Raises TypeError naming ``model`` for another layout."""
    return _head_weights(model, lens_parts(model))


def _head_weights(model: nn.Module, parts: LensParts) -> HeadWeights:
    """:func:`head_weights` from the parts :func:`lens_parts` found."""
    numbers, checkpoint_heads = head_numbers(model, sites=parts.sites)  # a pruned layer's heads keep theirs
    stacks: dict[str, list[torch.Tensor]] = {"W_Q": [], "W_K": [], "W_V": [], "W_O": []}
    for site, (w_o, _), kept in zip(parts.sites, parts.out_projections, numbers, strict=True):
        module = model.get_submodule(site.name)
        hidden = w_o.shape[0]
        found = _projections(module, hidden)
        if found is None:
            raise bad_argument(
                "model",
                "attention with q_proj/k_proj/v_proj Linear layers, or GPT-2's c_attn",
                f"{site.name}: {describe(module)}",
                "read this model's heads with activation_patching or direct_logit_attribution, which need no weights",
                kind=TypeError,
            )
        w_q, w_k, w_v = found
        h, g = site.num_heads, site.num_kv_heads
        d, e = w_q.shape[0] // h, w_v.shape[0] // g
        per_group = h // g
        layer = {
            "W_Q": w_q.reshape(h, d, hidden).transpose(1, 2),
            "W_K": w_k.reshape(g, d, hidden).transpose(1, 2).repeat_interleave(per_group, dim=0),
            "W_V": w_v.reshape(g, e, hidden).transpose(1, 2).repeat_interleave(per_group, dim=0),
            "W_O": w_o.reshape(hidden, h, e).permute(1, 2, 0),
        }
        for name, values in layer.items():
            every = values.new_full((checkpoint_heads, *values.shape[1:]), torch.nan)
            every[kept] = values
            stacks[name].append(every)
    with torch.no_grad():
        return HeadWeights(**{name: torch.stack(values).detach() for name, values in stacks.items()})


def _factored_norm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """||left @ right||_F for (..., d, r) @ (..., r, d'), from r x r Gram matrices."""
    gram_left = left.transpose(-1, -2) @ left  # (..., r, r)
    gram_right = right @ right.transpose(-1, -2)
    return (gram_left * gram_right).sum((-1, -2)).clamp_min(0).sqrt()


def composition_scores(model: nn.Module, mode: str) -> torch.Tensor:
    """Composition scores of every earlier head into every later one, (layers, heads, layers, heads): entry [l1,
    h1, l2, h2] is how much head (l1, h1)'s OV feeds head (l2, h2)'s query ("Q"), key ("K") or value ("V"), in
    [0, 1]; NaN where l2 <= l1. See the module docstring."""
    if mode not in COMPOSITIONS:
        raise bad_argument("mode", f"one of {list(COMPOSITIONS)}", repr(mode), 'pass e.g. mode="K"')
    w = head_weights(model)
    layers, heads = w.W_Q.shape[:2]
    # left (the earlier head's OV) = W_V W_O; right = W_Q W_K^T, its transpose W_K W_Q^T, or W_V W_O
    first, second = {"Q": (w.W_Q, w.W_K.transpose(-1, -2)), "K": (w.W_K, w.W_Q.transpose(-1, -2)), "V": (w.W_V, w.W_O)}[
        mode
    ]
    scores = torch.full((layers, heads, layers, heads), float("nan"), dtype=w.W_Q.dtype)
    ov_norms = _factored_norm(w.W_V, w.W_O)  # (layers, heads)
    right_norms = _factored_norm(first, second)
    value_grams = w.W_V.transpose(-1, -2) @ w.W_V  # (layers, heads, e, e)
    second_grams = second @ second.transpose(-1, -2)  # (layers, heads, d_head, d_head)
    for early in range(layers):
        for late in range(early + 1, layers):
            # L R = W_V (W_O first) second: ||L R||^2 = sum(W_V^T W_V * M G M^T), M = W_O first, G = second second^T
            middle = w.W_O[early][:, None] @ first[late][None]  # (h1, h2, e, d_head)
            inner = middle @ second_grams[late][None] @ middle.transpose(-1, -2)  # (h1, h2, e, e)
            product_norm = (value_grams[early][:, None] * inner).sum((-1, -2)).clamp_min(0).sqrt()
            scores[early, :, late] = product_norm / (ov_norms[early][:, None] * right_norms[late][None])
    return scores


@dataclass(frozen=True)
class HeadCircuit:
    """One head's circuits. ``qk`` and ``ov``: the singular values of W_Q W_K^T and W_V W_O, largest first (at most
    d_head of them). ``ov_reads`` and ``ov_writes`` (directions, top): the token ids whose embedding lies furthest
    along each of the first OV input directions, and whose unembedding row lies furthest along the matching output
    direction; ``qk_queries`` and ``qk_keys`` likewise for the QK circuit's query and key sides, read through the
    embedding. Each singular pair's sign is chosen so that its output (or key) side's largest token score is
    positive."""

    qk: torch.Tensor
    ov: torch.Tensor
    ov_reads: torch.Tensor
    ov_writes: torch.Tensor
    qk_queries: torch.Tensor
    qk_keys: torch.Tensor


def _svd(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U (d, r), S (r,), V (d', r) of left @ right, (d, r) @ (r, d'), from the factors: QR of each, then the r x r
    core's SVD."""
    q_left, r_left = torch.linalg.qr(left)
    q_right, r_right = torch.linalg.qr(right.T)
    u, s, vh = torch.linalg.svd(r_left @ r_right.T)
    return q_left @ u, s, q_right @ vh.T


def _readout(inputs: torch.Tensor, outputs: torch.Tensor, read_in: torch.Tensor, read_out: torch.Tensor, top: int):
    """The top tokens of each direction pair: ``read_in`` / ``read_out`` (vocab, d) score every token along the
    input / output directions (d, k); each pair's sign follows its output side's largest score."""
    out_scores = read_out @ outputs  # (vocab, k)
    largest = out_scores.gather(0, out_scores.abs().argmax(0, keepdim=True))  # (1, k)
    sign = torch.where(largest < 0, -1.0, 1.0).to(inputs.dtype)
    in_scores = read_in @ (inputs * sign)
    return in_scores.topk(top, dim=0).indices.T, (out_scores * sign).topk(top, dim=0).indices.T


def head_circuit(model: nn.Module, layer: int, head: int, *, directions: int = 3, top: int = 5) -> HeadCircuit:
    """The QK and OV circuits of head ``head`` of layer ``layer`` (see :class:`HeadCircuit`): the singular values,
    and the ``top`` tokens along each of the first ``directions`` singular directions."""
    parts = lens_parts(model)
    w = _head_weights(model, parts)
    layers, heads = w.W_Q.shape[:2]
    chosen = []
    for name, value, count in (("layer", layer, layers), ("head", head, heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_argument(name, "an int", describe(value), f"pass e.g. {name}=0", kind=TypeError)
        chosen.append(checked_indices(name, value, count, name)[0])  # a negative index counts from the end
    layer, head = chosen
    if w.W_Q[layer, head].isnan().any():
        raise bad_argument(
            "head", f"a head layer {layer} still has", f"head {head}, pruned", "pass one of the layer's heads"
        )
    embedding = _embedding(model)
    unembedding = parts.unembedding[0]
    vocab = min(embedding.shape[0], unembedding.shape[0])
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= vocab:
        raise bad_argument("top", f"an int in [1, {vocab}]", describe(top), "pass e.g. top=5")
    rank = min(w.W_Q.shape[-1], w.W_V.shape[-1])
    if not isinstance(directions, int) or isinstance(directions, bool) or not 1 <= directions <= rank:
        raise bad_argument("directions", f"an int in [1, {rank}]", describe(directions), "pass e.g. directions=3")
    with torch.no_grad():
        u_qk, s_qk, v_qk = _svd(w.W_Q[layer, head], w.W_K[layer, head].T)
        u_ov, s_ov, v_ov = _svd(w.W_V[layer, head], w.W_O[layer, head])
        embed, unembed = embedding.to(u_ov.dtype), unembedding.to(u_ov.dtype)
        ov_reads, ov_writes = _readout(u_ov[:, :directions], v_ov[:, :directions], embed, unembed, top)
        qk_queries, qk_keys = _readout(u_qk[:, :directions], v_qk[:, :directions], embed, embed, top)
    return HeadCircuit(s_qk, s_ov, ov_reads, ov_writes, qk_queries, qk_keys)


def _embedding(model: nn.Module) -> torch.Tensor:
    """The token embedding matrix (vocab, d_model)."""
    table = getattr(model, "token_embeddings", None)
    input_embeddings = getattr(model, "get_input_embeddings", None)
    if table is None and callable(input_embeddings):
        table = input_embeddings()
    weight = getattr(table, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise bad_argument(
            "model", "a model with token embeddings", describe(model), "pass a causal LM", kind=TypeError
        )
    return weight

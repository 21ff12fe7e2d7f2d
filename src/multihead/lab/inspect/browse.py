"""Every head over a whole corpus: the contexts where each of its measures runs highest, and each measure's
distribution, in memory that does not grow with the corpus.

    found = multihead.lab.inspect.browse_corpus(model, documents, top_k=8)   # model: load_minilm(), any on the kernel
    head = found.head(2, 5)                       # layer 2, head 5 (the checkpoint's number)
    head.top["previous-token"][0].pieces         # the pieces around the query where it weighs the piece before most
    head.histograms["entropy-high"].counts       # the measure's distribution over every query of the corpus

Documents stream through the model one at a time. A document longer than the model's positions is read in windows
that slide by half their length (:func:`multihead.lab.inspect.long.windows_of`), each holding the document's leading
and trailing special pieces; a body piece is measured as a query in the first window that holds it. Special
pieces ([CLS], [SEP], <bos>) are never measured as queries: they are the sinks.

The measures of :data:`MEASURES`, per head and query piece t of a window, from the weights ``w`` (its row of the
window's weights, which :func:`~multihead.capture.capture` records from the kernel's own call) and its output:

- ``max-off-sink``: the largest weight on a key that is not a special piece (a head that only parks on [CLS] or
  [SEP] scores low);
- ``output-norm``: the Euclidean norm of the head's output at t (before W^O): 0 for a head ablated to zero;
- ``entropy-low`` and ``entropy-high``: the row's entropy in nats, -sum w log w (the contexts of the lowest and of
  the highest; both report the entropy itself as their score);
- ``previous-token``: the weight on the piece before t (Olsson et al. 2022's previous-token heads);
- ``prefix-matching``: the weight on the pieces right after an earlier occurrence of t's own piece (the pieces j
  with piece j - 1 equal to piece t, j - 1 != t: where an induction head looks).

Kept per head: for each measure its :data:`top_k` contexts (the query's pieces within ``context`` of it in its
window, with the query's weights on them), the highest first, ties going to the earlier document and piece; and a
:class:`MeasureHistogram` of its values over every measured query, on fixed bins (weights and scores in [0, 1],
entropy in [0, ln(positions)], output norms on a log scale), so its counts are exact and need no second pass.

And over the corpus, a uniform sample of ``samples`` query pieces (reservoir sampling, seeded: the same corpus
gives the same sample), the same pieces for every head: each head's queries and keys there, its values and its
outputs, projected to 2-D by PCA (:attr:`HeadBrowse.projections`): queries and keys in one projection, so that the
keys a query meets lie near it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multihead._errors import bad_argument, describe, positive_int
from multihead._indices import checked_indices
from multihead.capture import capture, part_sites
from multihead.lab.inspect.long import checked_window, special_ends, windows_of
from multihead.lab.inspect.recording import head_numbers, is_causal_part
from multihead.lab.models.contract import evaluating, text_tokenizer

__all__ = [
    "MEASURES",
    "TopContext",
    "MeasureHistogram",
    "HeadBrowse",
    "CorpusBrowse",
    "browse_corpus",
    "bundled_documents",
    "read_documents",
]

MEASURES = ("max-off-sink", "output-norm", "entropy-low", "entropy-high", "previous-token", "prefix-matching")
_RANKED_LOW = {"entropy-low"}  # measures whose lowest values are the top contexts
# each measure's sign in the ranking: its top contexts are its highest values times this
_RANK_SIGNS = torch.tensor([-1.0 if name in _RANKED_LOW else 1.0 for name in MEASURES], dtype=torch.float64)
WEIGHT_BINS = 20  # bins of the measures in [0, 1]
ENTROPY_BINS = 20
NORM_EDGES = tuple(10.0 ** (exponent / 4) for exponent in range(-12, 13))  # 1e-3 .. 1e3, 4 bins a decade
PROJECTIONS = ("queries and keys", "values", "outputs")
# the most bytes of weights one batch of windows records (every recorded head's (n, n) weights, float32): a batch of
# short sentences fills batch_size first; windows of 1,024 pieces of a 12 x 12-head model (604 MiB each) run alone
WEIGHT_BUDGET = 256 * 2**20
SAMPLE_SEED = 0  # the reservoir's generator: the same corpus gives the same sample


@dataclass(frozen=True)
class TopContext:
    """One of a head's top contexts for a measure: ``score`` (the measure's value), the ``document`` (its index in
    the corpus) and the query's ``position`` there (a piece index, as the tokenizer splits the whole document);
    ``pieces``: the pieces of its window within ``context`` of the query, ``query`` the query's index among them,
    ``weights`` the query's weight on each of them."""

    score: float
    document: int
    position: int
    pieces: list[str]
    query: int
    weights: list[float]

    def to_dict(self) -> dict:
        return {
            "score": round(self.score, 6),
            "document": self.document,
            "position": self.position,
            "pieces": self.pieces,
            "query": self.query,
            "weights": [round(weight, 4) for weight in self.weights],
        }


@dataclass(frozen=True)
class MeasureHistogram:
    """A measure's values over every measured query: ``counts[b]`` of them in [edges[b], edges[b + 1]) (the last
    bin closed), ``below`` and ``above`` those outside the edges."""

    edges: list[float]
    counts: list[int]
    below: int = 0
    above: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts) + self.below + self.above

    def to_dict(self) -> dict:
        return {
            "edges": [float(f"{edge:.6g}") for edge in self.edges],
            "counts": self.counts,
            "below": self.below,
            "above": self.above,
        }


@dataclass
class HeadBrowse:
    """One head over the corpus: ``layer`` and ``head`` (the checkpoint's number), its ``top`` contexts and
    ``histograms`` per measure, and each measure's ``mean`` over the measured queries."""

    layer: int
    head: int
    top: dict[str, list[TopContext]]
    histograms: dict[str, MeasureHistogram]
    mean: dict[str, float]
    # PROJECTIONS -> (points, 2) PCA coordinates over the sampled pieces: "queries and keys" holds the queries
    # then the keys (2 x samples points), "values" and "outputs" one point per sample
    projections: dict[str, torch.Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "head": self.head,
            "mean": {name: round(value, 6) for name, value in self.mean.items()},
            "top": {name: [context.to_dict() for context in contexts] for name, contexts in self.top.items()},
            "histograms": {name: histogram.to_dict() for name, histogram in self.histograms.items()},
            "projections": {
                name: [[round(x, 4), round(y, 4)] for x, y in points.tolist()]
                for name, points in self.projections.items()
            },
        }


@dataclass
class CorpusBrowse:
    """What :func:`browse_corpus` found: the ``model``'s name, the ``part`` read and whether it is ``causal``,
    the ``documents`` and ``queries`` measured, the ``top_k`` and ``context`` kept, and a :class:`HeadBrowse` per
    chosen head (layer by layer)."""

    model: str
    part: str
    causal: bool
    documents: int
    queries: int
    top_k: int
    context: int
    heads: list[HeadBrowse] = field(default_factory=list)
    # the sampled query pieces, the same for every head: (document, position, piece), in sample order
    samples: list[tuple[int, int, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready, bounded: top_k contexts of 2 x context + 1 pieces and a histogram per head and measure,
        whatever the corpus's size."""
        return {
            "model": self.model,
            "part": self.part,
            "causal": self.causal,
            "documents": self.documents,
            "queries": self.queries,
            "top_k": self.top_k,
            "context": self.context,
            "measures": list(MEASURES),
            "samples": [list(sample) for sample in self.samples],
            "heads": [head.to_dict() for head in self.heads],
        }

    def head(self, layer: int, head: int) -> HeadBrowse:
        """The browse of ``layer``'s head ``head`` (the checkpoint's number)."""
        for found in self.heads:
            if (found.layer, found.head) == (layer, head):
                return found
        have = sorted({(found.layer, found.head) for found in self.heads})
        raise bad_argument("head", f"a browsed (layer, head) of {have}", (layer, head), "pick one of those")


def bundled_documents() -> list[str]:
    """The bundled UD English EWT dev split's 2,001 sentences as documents (CC BY-SA 4.0; see
    multihead/lab/data/ud-english-ewt)."""
    from multihead.lab.inspect.syntax import bundled_treebank

    return [sentence.text or " ".join(sentence.words) for sentence in bundled_treebank()]


def read_documents(path: str | Path, *, argument: str = "corpus") -> Iterator[str]:
    """The documents of a corpus on disk, streamed: each non-blank line of a text file, or each ``*.txt`` file of a
    folder (sorted by name, its whole text one document). ValueError naming ``argument`` where there is none."""
    source = Path(path)
    if source.is_dir():
        files = sorted(source.glob("*.txt"))
        if not files:
            raise bad_argument(argument, "a folder holding .txt files", f"{source} with none", "point at such a folder")
        for file in files:
            text = file.read_text(encoding="utf-8")
            if text.strip():
                yield text
        return
    if not source.is_file():
        raise bad_argument(argument, "a text file or a folder of .txt files", f"{source}: not found", "check the path")
    with source.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield line.rstrip("\n")


def browse_corpus(
    model: torch.nn.Module,
    documents: Iterable[str],
    *,
    part: str | None = None,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    top_k: int = 8,
    context: int = 8,
    window: int | None = None,
    batch_size: int = 16,
    samples: int = 256,
    progress: Callable[[int, int | None], None] | None = None,
) -> CorpusBrowse:
    """Measure every chosen head of ``model`` over ``documents`` (see the module docstring).

    Args:
        model: a text model on the kernel with its tokenizer (:func:`multihead.lab.models.load_minilm`,
            :func:`multihead.integrations.load_text_model`).
        documents: the corpus, one string per document (a list, or a stream such as :func:`read_documents`).
        part: the part of the model's attention (default its first).
        layers, heads: the layers and heads to measure (default all), as :func:`~multihead.capture.capture` counts
            them; each :class:`HeadBrowse` names its head by the checkpoint's number (a pruned model's heads keep
            theirs).
        top_k: contexts kept per head and measure.
        context: pieces kept on each side of a context's query.
        window: pieces per window, specials included (default: the model's positions).
        batch_size: windows per forward pass (padded to the longest of them; each gives the weights it gives
            alone), fewer where their recorded weights would pass :data:`WEIGHT_BUDGET`.
        samples: query pieces sampled from the corpus for the heads' projections (0: none).
        progress: called as ``progress(done, total)`` after each document (total: ``len(documents)`` where it
            has one, else None).

    Returns:
        :class:`CorpusBrowse`.

    Raises:
        ValueError or TypeError naming ``documents``, ``top_k``, ``context``, ``window``, ``batch_size``,
        ``samples``, ``layers``, ``heads`` or ``part``.
    """
    tokenizer = text_tokenizer(model)
    top_k = positive_int("top_k", top_k)
    batch_size = positive_int("batch_size", batch_size)
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise bad_argument("samples", "an int >= 0 (pieces sampled for the projections)", describe(samples), "e.g. 256")
    if not isinstance(context, int) or isinstance(context, bool) or context < 0:
        raise bad_argument("context", "an int >= 0 (pieces on each side of a query)", describe(context), "e.g. 8")
    if isinstance(documents, str | bytes) or not isinstance(documents, Iterable):
        raise bad_argument(
            "documents",
            "an iterable of strings, one per document",
            describe(documents),
            "pass a list of texts (or read_documents(path))",
            kind=TypeError,
        )
    chosen_part, sites = part_sites(model, part)
    numbers, _ = head_numbers(model, sites=sites)
    chosen_layers = checked_indices("layers", layers, len(sites), "layer")
    layer_heads = {layer: checked_indices("heads", heads, len(numbers[layer]), "head") for layer in chosen_layers}
    size = checked_window(window, tokenizer.max_length)
    causal = is_causal_part(model, chosen_part)
    total = len(documents) if isinstance(documents, Sequence) else None
    tallies = {layer: _LayerTally(len(layer_heads[layer]), top_k, context, size) for layer in chosen_layers}
    sampler = _Sampler(samples, chosen_layers)
    reader = _WindowReader(model, chosen_part, chosen_layers, heads, tallies, sampler, batch_size, progress, total)
    for index, text in enumerate(documents):
        windows = _windows_of(index, text, tokenizer, size)
        for number, stretch in enumerate(windows):
            reader.read(stretch, number == len(windows) - 1)
        if not windows:  # nothing but special pieces: no query to measure
            reader.document_done()
    reader.flush()
    done, queries = reader.documents, reader.queries
    if done == 0:
        raise bad_argument("documents", "at least one document", "none", "pass a corpus with text in it")
    browse = CorpusBrowse(
        model=getattr(model, "name", type(model).__name__),
        part=chosen_part,
        causal=causal,
        documents=done,
        queries=queries,
        top_k=top_k,
        context=context,
    )
    browse.samples = list(sampler.where)
    for layer in chosen_layers:
        for column, position in enumerate(layer_heads[layer]):
            found = tallies[layer].head(layer, numbers[layer][position], column)
            found.projections = sampler.projections(layer, column)
            browse.heads.append(found)
    return browse


def _windows_of(index: int, text: object, tokenizer, size: int) -> list[_Window]:
    """Document ``index``'s windows of ``size`` pieces (its specials in each), each with the body pieces it measures
    (those no earlier window measured); none for a document of special pieces alone."""
    if not isinstance(text, str) or not text.strip():
        raise bad_argument(
            "documents", "non-empty strings", f"document {index}: {describe(text)}", "drop the empty ones"
        )
    batch = tokenizer.batch([text], max_length=10**9)
    ids, pieces = batch.input_ids[0], batch.pieces[0]
    lead, trail = special_ends(pieces.word_ids)
    if size <= lead + trail:
        raise bad_argument("window", f"more than the {lead + trail} special pieces", size, "pass a larger window")
    body = len(ids) - lead - trail
    windows, measured_until = [], 0
    for start, stop in windows_of(body, size - lead - trail) if body else []:
        window_ids = torch.cat([ids[:lead], ids[lead + start : lead + stop], ids[len(ids) - trail :]])
        places = torch.cat(
            [torch.arange(lead), lead + torch.arange(start, stop), len(ids) - trail + torch.arange(trail)]
        )
        rows = list(range(lead + max(0, measured_until - start), lead + stop - start))  # its new body pieces
        measured_until = stop
        tokens = [pieces.tokens[p] for p in places.tolist()]
        windows.append(_Window(index, window_ids, places, tokens, lead, trail, rows))
    return windows


@dataclass(frozen=True)
class _Window:
    """One window of one document: its ``ids`` (n,), each piece's ``places`` in the document (n,), its ``tokens``,
    the ``lead`` and ``trail`` special pieces, and the ``rows`` it measures as queries."""

    document: int
    ids: torch.Tensor
    places: torch.Tensor
    tokens: list[str]
    lead: int
    trail: int
    rows: list[int]


class _WindowReader:
    """Windows through the model ``batch_size`` at a time, right-padded (a padded key is masked, so each window's
    weights and outputs are those it gives alone), each folded into its layers' tallies; counts the documents done
    (a document is done once its last window is read) and reports them to ``progress``."""

    def __init__(self, model, part, layers, heads, tallies, sampler, batch_size, progress, total):
        self.model, self.part, self.layers, self.heads, self.tallies = model, part, layers, heads, tallies
        self.sampler = sampler
        self.recorded_heads = sum(tally.ranked.shape[0] for tally in tallies.values())  # over every layer
        self.batch_size, self.progress, self.total = batch_size, progress, total
        self.device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
        self.pending: list[tuple[_Window, bool]] = []
        self.documents = self.queries = 0

    def read(self, window: _Window, last_of_its_document: bool) -> None:
        """Queue ``window``; the queue runs once it holds ``batch_size`` windows, or before the weights the model
        would record for it pass WEIGHT_BUDGET (a batch of long windows: every recorded head's (n, n) weights)."""
        longest = max([len(window.ids), *(len(queued.ids) for queued, _ in self.pending)])
        if self.pending and (len(self.pending) + 1) * self.recorded_heads * longest**2 * 4 > WEIGHT_BUDGET:
            self.flush()
        self.pending.append((window, last_of_its_document))
        if len(self.pending) == self.batch_size:
            self.flush()

    def document_done(self) -> None:
        self.flush()  # its earlier documents first, in order
        self.documents += 1
        if self.progress is not None:
            self.progress(self.documents, self.total)

    def flush(self) -> None:
        if not self.pending:
            return
        windows, self.pending = self.pending, []
        longest = max(len(window.ids) for window, _ in windows)
        input_ids = torch.zeros(len(windows), longest, dtype=torch.long)
        attention_mask = torch.zeros(len(windows), longest, dtype=torch.long)
        for row, (window, _) in enumerate(windows):
            input_ids[row, : len(window.ids)] = window.ids
            attention_mask[row, : len(window.ids)] = 1
        with (
            evaluating(self.model),
            torch.no_grad(),
            capture(
                self.model,
                part=self.part,
                layers=self.layers,
                heads=self.heads,
                outputs=True,
                qkv=self.sampler.size > 0,
            ) as rec,
        ):
            self.model(input_ids.to(self.device), attention_mask.to(self.device))
        # which measured rows of these windows enter the sample, and the slot each takes
        taken = [
            (row, window.rows[index], slot)
            for row, (window, _) in enumerate(windows)
            for index, slot in self.sampler.draw(window)
        ]
        for layer in self.layers:
            weights, outputs = rec.weights(layer).cpu(), rec.outputs(layer).cpu()
            for row, (window, _) in enumerate(windows):  # in float64 one window at a time
                n = len(window.ids)
                self.tallies[layer].add(window, weights[row, :, :n, :n].double(), outputs[row, :, :n].double())
            if taken:
                spaces = (rec.q(layer), rec.k(layer), rec.v(layer), outputs)
                self.sampler.store(layer, taken, [space.float().cpu() for space in spaces])
        for window, last in windows:
            self.queries += len(window.rows)
            if last:
                self.documents += 1
                if self.progress is not None:
                    self.progress(self.documents, self.total)


class _Sampler:
    """A uniform sample of ``size`` measured query pieces over the corpus (Algorithm R, seeded), the same pieces for
    every layer and head: each slot's (document, position, piece) and, per layer, its (slot, h, x) queries, keys,
    values and outputs."""

    def __init__(self, size: int, layers: Sequence[int]):
        self.size = size
        self.generator = torch.Generator().manual_seed(SAMPLE_SEED)
        self.seen = 0
        self.where: list[tuple[int, int, str]] = []
        self.vectors: dict[int, list[torch.Tensor] | None] = {layer: None for layer in layers}

    def draw(self, window: _Window) -> list[tuple[int, int]]:
        """The window's measured rows that enter the sample, as (index into window.rows, slot); a row taking a slot
        an earlier row of the same draw took replaces it (the later wins, as Algorithm R)."""
        taken = []
        for index, row in enumerate(window.rows):
            if self.seen < self.size:
                slot = self.seen
                self.where.append((0, 0, ""))
            else:
                slot = int(torch.randint(0, self.seen + 1, (1,), generator=self.generator))
            self.seen += 1
            if slot < self.size:
                self.where[slot] = (window.document, int(window.places[row]), window.tokens[row])
                taken.append((index, slot))
        return taken

    def store(self, layer: int, taken: list[tuple[int, int, int]], spaces: list[torch.Tensor]) -> None:
        """Write the taken pieces' vectors: ``taken`` (batch row, the piece's place in its window, slot),
        ``spaces`` the batch's (B, h, n, x) queries, keys, values and outputs."""
        stored = self.vectors[layer]
        if stored is None:
            stored = self.vectors[layer] = [torch.zeros(self.size, space.shape[1], space.shape[3]) for space in spaces]
        for row, place, slot in taken:
            for kept, space in zip(stored, spaces, strict=True):
                kept[slot] = space[row, :, place]

    def projections(self, layer: int, column: int) -> dict[str, torch.Tensor]:
        """Head ``column``'s PCA projections (see :data:`PROJECTIONS`); none without a sample."""
        stored = self.vectors.get(layer)
        if stored is None:
            return {}
        count = min(self.seen, self.size)
        q, k, v, out = (space[:count, column].double() for space in stored)
        return {"queries and keys": pca_2d(torch.cat([q, k])), "values": pca_2d(v), "outputs": pca_2d(out)}


def pca_2d(points: torch.Tensor) -> torch.Tensor:
    """(n, x) -> (n, 2): the points centred and projected on their two principal axes, each axis's sign set so
    that its largest loading is positive (the same points give the same picture). Fewer than two axes of spread
    (n < 2, or all points equal) give zeros there."""
    centred = points - points.mean(0, keepdim=True)
    if centred.shape[0] < 2:
        return torch.zeros(centred.shape[0], 2, dtype=points.dtype)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    axes = vh[:2]  # (<= 2, x)
    signs = torch.sign(axes.gather(1, axes.abs().argmax(1, keepdim=True)))
    coordinates = centred @ (axes * torch.where(signs == 0, 1.0, signs)).T
    if coordinates.shape[1] < 2:
        coordinates = torch.cat([coordinates, torch.zeros(coordinates.shape[0], 2 - coordinates.shape[1])], 1)
    return coordinates


def window_measures(found: _Window, weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """(h, M, rows): every measure of :data:`MEASURES` for each head and measured row of one window, from its
    weights (h, n, n) and the heads' outputs (h, n, e)."""
    rows = torch.tensor(found.rows, dtype=torch.long)
    w = weights[:, rows]  # (h, rows, n)
    heads, n = w.shape[0], w.shape[-1]
    sinks = torch.zeros(n, dtype=torch.bool)
    sinks[: found.lead] = True
    sinks[n - found.trail :] = True
    off_sink = w.masked_fill(sinks, 0.0).amax(-1)
    norm = outputs[:, rows].norm(dim=-1)
    entropy = -(w * w.clamp_min(torch.finfo(w.dtype).tiny).log()).sum(-1)
    before = (rows - 1).clamp_min(0)
    previous = torch.where(rows > 0, w.gather(-1, before.expand(heads, -1)[..., None])[..., 0], 0.0)
    # key j follows an earlier occurrence of the query's piece: piece j - 1 equals piece t, and j - 1 is not t
    after = torch.zeros(len(rows), n, dtype=torch.bool)
    after[:, 1:] = found.ids[None, :-1] == found.ids[rows][:, None]
    own = rows + 1 < n
    after[torch.arange(len(rows))[own], (rows + 1)[own]] = False
    prefix = (w * after).sum(-1)
    return torch.stack([off_sink, norm, entropy, entropy, previous, prefix], 1)


def _edges(measure: str, positions: int) -> torch.Tensor:
    """The fixed bin edges of a measure's histogram (float64)."""
    if measure == "output-norm":
        return torch.tensor(NORM_EDGES, dtype=torch.float64)
    if measure.startswith("entropy"):
        return torch.linspace(0.0, math.log(positions), ENTROPY_BINS + 1, dtype=torch.float64)
    return torch.linspace(0.0, 1.0, WEIGHT_BINS + 1, dtype=torch.float64)


def _binned(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """(h, bins + 2) counts of ``values`` (h, rows): below the edges, each bin [edges[b], edges[b + 1]) (the last
    closed), above them."""
    index = torch.bucketize(values.contiguous(), edges, right=True)  # 0: below; len(edges): at or above the last edge
    index = torch.where(values == edges[-1], len(edges) - 1, index)
    counts = torch.zeros(values.shape[0], len(edges) + 1, dtype=torch.long)
    return counts.scatter_add_(1, index, torch.ones_like(index))


class _LayerTally:
    """One layer's h chosen heads over the windows so far: each measure's top-k (ranked scores, and the contexts
    behind them, built when they enter) and its histogram's counts."""

    def __init__(self, heads: int, top_k: int, context: int, positions: int):
        self.top_k, self.context = top_k, context
        self.ranked = torch.empty(heads, len(MEASURES), 0, dtype=torch.float64)  # (h, M, kept): best first
        self.contexts: list[list[list[TopContext]]] = [[[] for _ in MEASURES] for _ in range(heads)]
        self.edges = [_edges(measure, positions) for measure in MEASURES]
        self.counts = [torch.zeros(heads, len(edges) + 1, dtype=torch.long) for edges in self.edges]
        self.sums = torch.zeros(heads, len(MEASURES), dtype=torch.float64)
        self.queries = 0

    def add(self, found: _Window, weights: torch.Tensor, outputs: torch.Tensor) -> None:
        """Fold in one window: its weights (h, n, n) and the heads' outputs (h, n, e)."""
        if not found.rows:
            return
        values = window_measures(found, weights, outputs)  # (h, M, rows)
        self.sums += values.sum(-1)
        self.queries += values.shape[-1]
        for measure, edges in enumerate(self.edges):
            self.counts[measure] += _binned(values[:, measure], edges)
        joined = torch.cat([self.ranked, values * _RANK_SIGNS[:, None]], -1)  # the kept first: a tie keeps the earlier
        order = joined.sort(dim=-1, descending=True, stable=True).indices[..., : self.top_k]
        kept = self.ranked.shape[-1]
        self.ranked = joined.gather(-1, order)
        for head, per_measure in enumerate(order.tolist()):
            for measure, picked in enumerate(per_measure):
                if len(picked) == kept and max(picked) < kept:  # nothing of this window entered
                    continue
                before = self.contexts[head][measure]
                self.contexts[head][measure] = [
                    before[index]
                    if index < kept
                    else self._context(found, index - kept, weights[head], float(values[head, measure, index - kept]))
                    for index in picked
                ]

    def _context(self, found: _Window, row_index: int, weights: torch.Tensor, score: float) -> TopContext:
        """The context of the window's measured row ``row_index``: its pieces within ``context`` of the query."""
        row = found.rows[row_index]
        first, stop = max(0, row - self.context), min(len(found.tokens), row + self.context + 1)
        return TopContext(
            score=score,
            document=found.document,
            position=int(found.places[row]),
            pieces=found.tokens[first:stop],
            query=row - first,
            weights=weights[row, first:stop].tolist(),
        )

    def head(self, layer: int, number: int, column: int) -> HeadBrowse:
        """The :class:`HeadBrowse` of the tally's head ``column``, checkpoint head ``number`` of ``layer``."""
        top = {name: list(self.contexts[column][measure]) for measure, name in enumerate(MEASURES)}
        histograms = {}
        for measure, name in enumerate(MEASURES):
            counts = self.counts[measure][column].tolist()
            histograms[name] = MeasureHistogram(self.edges[measure].tolist(), counts[1:-1], counts[0], counts[-1])
        mean = {name: float(self.sums[column, m]) / max(1, self.queries) for m, name in enumerate(MEASURES)}
        return HeadBrowse(layer, number, top, histograms, mean)

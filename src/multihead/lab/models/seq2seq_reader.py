"""A :class:`~multihead.lab.models.seq2seq.Seq2Seq` as a text reader, so inspect, capture and the importance tools open
an encoder-decoder trained on a synthetic task (``multihead train``'s reverse task) like any other model.

The text is the **source**: its symbols separated by spaces, without ``<bos>`` (the tasks' sources never hold
it). The decoder reads the model's own greedy output shifted right after the start token (``<bos>``, id 0), so
each part's attention goes between these pieces:

    part       queries i                    keys j
    "encoder"  the source                   the source
    "decoder"  <bos>, the output so far     the same (causal)
    "cross"    <bos>, the output so far     the source

    reader = load_seq2seq_reader("multihead-train/model")
    inspect_text(reader, "a b c d", part="cross")     # (heads, 4 target positions, 4 source positions)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.attend import AttentionSite, register_site_finder
from multihead.lab.models.contract import TextEncoder, evaluating
from multihead.lab.models.seq2seq import Seq2Seq, load_seq2seq
from multihead.lab.models.symbols import BOS_SYMBOL, SymbolTokenizer, read_symbols
from multihead.lab.models.tokenizer import Pieces, TokenBatch
from multihead.layer import MultiHeadAttention

__all__ = ["SourceTokenizer", "Seq2SeqReader", "load_seq2seq_reader"]


class SourceTokenizer(SymbolTokenizer):
    """A :class:`SymbolTokenizer` for the source of an encoder-decoder: the text's symbols as they are, no
    ``<bos>`` put first (a seq2seq task's source does not start with one; its decoder does)."""

    def __init__(self, symbols: Sequence[str], *, max_length: int):
        super().__init__(symbols, max_length=max_length)
        self.bos_id = None  # the batch puts <bos> first only when the tokenizer has one


class Seq2SeqReader(TextEncoder):
    """A :class:`Seq2Seq` as a :class:`TextEncoder`: the text is the source, the decoder reads the model's own
    greedy output (see the module docstring). Its attention sites are the Seq2Seq's parts "encoder", "decoder"
    (causal) and "cross".

    ``seq2seq``: the model; ``tokenizer``: a :class:`SymbolTokenizer` making the source ids (use
    :class:`SourceTokenizer`: a ``<bos>`` first would be a source token the model never saw), or None (ids only);
    ``start_id``: the decoder's start token (0, ``<bos>``, in the tasks).
    ``forward(input_ids, attention_mask, token_type_ids)`` returns the decoder's (b, n, hidden) final states
    (after the final LayerNorm) on n target positions, one per source token. Padding must be on the right.
    """

    is_causal = False  # the encoder and the cross-attention see every source token; the "decoder" part is causal
    described_as = "an encoder-decoder saved by Seq2Seq.save (a multihead train reverse checkpoint)"

    def __init__(
        self,
        seq2seq: Seq2Seq,
        *,
        tokenizer: SymbolTokenizer | None = None,
        name: str | None = None,
        start_id: int = 0,
    ):
        if not isinstance(seq2seq, Seq2Seq):
            raise bad_argument(
                "seq2seq", "a Seq2Seq", describe(seq2seq), "pass a multihead.lab.models.Seq2Seq", kind=TypeError
            )
        if tokenizer is not None and not isinstance(tokenizer, SymbolTokenizer):
            raise bad_argument(
                "tokenizer",
                "a SymbolTokenizer (or None)",
                describe(tokenizer),
                "pass SourceTokenizer(task_symbols(vocab_size), max_length=...)",
                kind=TypeError,
            )
        if tokenizer is not None and len(tokenizer.symbols) != seq2seq.config.vocab_size:
            raise bad_argument(
                "tokenizer",
                f"{seq2seq.config.vocab_size} symbols (the model's vocab_size)",
                len(tokenizer.symbols),
                "pass the symbols the model was trained with",
            )
        if not isinstance(start_id, int) or isinstance(start_id, bool) or not 0 <= start_id < seq2seq.config.vocab_size:
            raise bad_argument(
                "start_id",
                f"a token id (int) in 0..{seq2seq.config.vocab_size - 1}",
                describe(start_id),
                "pass the decoder's start token, e.g. 0",
            )
        super().__init__(tokenizer=tokenizer, name=name or seq2seq.name)
        self.seq2seq = seq2seq
        self.start_id = start_id

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        """The Seq2Seq's layers: the encoder's, the decoder's self-attention, then the cross-attention."""
        return self.seq2seq.attention_layers

    def attention_sites(self) -> list[AttentionSite]:
        """The Seq2Seq's sites (parts "encoder", "decoder", "cross"), named by their path in this reader."""
        return [dataclasses.replace(site, name=f"seq2seq.{site.name}") for site in self.seq2seq.attention_sites()]

    def _check_padding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise bad_argument(
                "attention_mask",
                f"a tensor of input_ids' shape {tuple(input_ids.shape)}, 1 for real tokens",
                describe(attention_mask),
                "pass the tokenizer batch's attention_mask",
                kind=TypeError if not isinstance(attention_mask, torch.Tensor) else ValueError,
            )
        mask = attention_mask.bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):  # a real token after padding
            raise bad_argument(
                "attention_mask",
                "padding on the right only (the decoder's target positions line up with the source's)",
                "a real token after a padded one",
                "pad each sequence at its end",
            )
        return mask

    def decoder_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(b, n) source ids, (b, n) right-padding mask -> (b, n) decoder input: the start token, then the
        model's first n - 1 greedy tokens (eval mode, no autograd)."""
        mask = self._check_padding(input_ids, attention_mask)
        n = input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else 1
        with evaluating(self):
            generated = self.seq2seq.generate(input_ids, max(n - 1, 0), source_mask=mask, start_id=self.start_id)
        return generated  # (b, 1 + n - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, n) source ids, (b, n) right-padding mask (1 = real token) -> (b, n, hidden) the decoder's final
        states on :meth:`decoder_input`.

        Greedy decoding runs first (one decoder call per token), then one full pass over the source and the
        decoder input: a capture's last call of every part (what its readers take) is that pass.
        """
        target = self.decoder_input(input_ids, attention_mask)  # (b, n)
        mask = None if attention_mask is None else attention_mask.bool()
        states: list[torch.Tensor] = []
        handle = self.seq2seq.final_norm.register_forward_hook(lambda module, args, output: states.append(output))
        try:
            self.seq2seq(input_ids, target, mask)
        finally:
            handle.remove()
        return states[-1]  # (b, n, hidden)

    def part_pieces(self, batch: TokenBatch, part: str) -> tuple[list[Pieces], list[Pieces]]:
        """ "encoder": the source on both axes; "decoder": the decoder input (the start token, then the greedy
        output so far, each symbol a word) on both; "cross": the decoder input as queries, the source as keys."""
        if part == "encoder":
            return batch.pieces, batch.pieces
        if part not in ("decoder", "cross"):
            raise bad_argument(
                "part", 'one of the model\'s parts ["encoder", "decoder", "cross"]', repr(part), 'pass part="cross"'
            )
        target = self.decoder_input(batch.input_ids, batch.attention_mask)  # (b, n)
        pieces = [
            Pieces.each_own_word(
                [self._piece(int(token)) for token in row[: len(tokens)]],
                [int(token) == self.start_id for token in row[: len(tokens)]],
            )
            for row, tokens in zip(target.tolist(), batch.tokens, strict=True)
        ]
        return (pieces, pieces) if part == "decoder" else (pieces, batch.pieces)

    def _piece(self, token_id: int) -> str:
        if isinstance(self.tokenizer, SymbolTokenizer):
            return self.tokenizer.piece(token_id)
        return BOS_SYMBOL if token_id == self.start_id else str(token_id)


def _sites(model: nn.Module) -> list[AttentionSite] | None:
    return model.attention_sites() if isinstance(model, Seq2SeqReader) else None


register_site_finder(_sites)


def load_seq2seq_reader(folder: str | Path, *, dtype: torch.dtype | None = None) -> Seq2SeqReader:
    """The Seq2Seq saved in ``folder`` (:meth:`Seq2Seq.save`, as ``multihead train`` writes it) as a
    :class:`Seq2SeqReader`, with the :class:`SourceTokenizer` of its ``symbols.json`` when the folder has one
    (else no tokenizer: ids only). Eval mode."""
    seq2seq = load_seq2seq(folder, dtype=dtype)
    symbols = read_symbols(Path(folder), seq2seq.config.vocab_size)
    tokenizer = None
    if symbols is not None:
        # n source tokens are decoded into n target positions: 1 + (n - 1) new tokens fit max_positions
        tokenizer = SourceTokenizer(symbols, max_length=seq2seq.config.max_positions)
    return Seq2SeqReader(seq2seq, tokenizer=tokenizer).eval()

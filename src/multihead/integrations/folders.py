"""The one door the command line opens for ``--model``: :func:`load_text_model` gives our own encoder for the
checkpoints it reads (all-MiniLM-L6-v2, BERT-style saves, saves of ``multihead heads prune``) and any other
transformers checkpoint through :mod:`multihead.integrations.transformers_models`, which imports transformers
only then; :func:`load_causal_lm` the causal language models circuits reads. Both need the lab extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from multihead._errors import bad_argument
from multihead._userfiles import path_kind
from multihead.lab.models.bert import SAVED_CONFIG
from multihead.lab.models.contract import CausalLM, TextEncoder
from multihead.lab.models.decoder import DECODER_CONFIG
from multihead.lab.models.loading import SERVED_MODEL_TYPES, conversion_fix, load_encoder, other_formats
from multihead.lab.models.seq2seq import SEQ2SEQ_CONFIG
from multihead.lab.models.seq2seq_reader import load_seq2seq_reader
from multihead.lab.models.symbols import load_decoder_reader

__all__ = ["load_text_model", "load_causal_lm"]


def _transformers_config(folder: Path) -> dict | None:
    """config.json as a dict where transformers should read the folder; None where our loader should (a save of
    ours, no config.json, or one that is unreadable, not JSON or not an object: the loader says what is wrong)."""
    if path_kind(folder / SAVED_CONFIG) == "file" or path_kind(folder / "config.json") != "file":
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _model_type(config: dict | None) -> str | None:
    """config.json's model_type (see :func:`_transformers_config`), or None."""
    kind = None if config is None else config.get("model_type")
    return kind if isinstance(kind, str) else None


def load_text_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> TextEncoder:
    """The text model in folder ``path`` (None: the bundled all-MiniLM-L6-v2), on multihead's kernel.

    A checkpoint of a BERT-style encoder (config.json's model_type "bert", or a save of ours) loads on our
    own :class:`~multihead.lab.models.Encoder`; a folder written by :meth:`multihead.lab.models.Decoder.save` (such as
    ``multihead train``'s checkpoints) as a :class:`~multihead.lab.models.DecoderReader`, one written by
    :meth:`multihead.lab.models.Seq2Seq.save` as a :class:`~multihead.lab.models.Seq2SeqReader`; any other
    model_type through transformers (:func:`multihead.integrations.transformers_models.load_model`), which must
    then be installed; so does a BERT folder whose weights are pytorch_model.bin or whose tokenizer is vocab.txt
    (without transformers, the error gives the commands that convert them to the files our encoder reads).
    """
    if path is None:
        return load_encoder(None, dtype=dtype)
    if isinstance(path, (str, Path)) and path_kind(Path(path) / DECODER_CONFIG) == "file":
        return load_decoder_reader(path, dtype=dtype)  # a Decoder.save (multihead train's checkpoints)
    if isinstance(path, (str, Path)) and path_kind(Path(path) / SEQ2SEQ_CONFIG) == "file":
        return load_seq2seq_reader(path, dtype=dtype)  # a Seq2Seq.save (multihead train reverse)
    kind = _model_type(_transformers_config(Path(path)))
    convertible = other_formats(Path(path)) if kind in SERVED_MODEL_TYPES else {}
    if kind is None or (kind in SERVED_MODEL_TYPES and not convertible):
        return load_encoder(path, dtype=dtype)
    try:
        from multihead.integrations.transformers_models import load_model
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("transformers"):
            raise
        if convertible:  # a BERT folder in the formats transformers reads: install it, or convert the files
            stand_ins = ", ".join(f"{other} instead of {name}" for name, other in convertible.items())
            raise bad_argument(
                "model",
                "a BERT folder with model.safetensors and tokenizer.json, or transformers installed to read it",
                f"{str(path)!r} with {stand_ins}, without transformers",
                conversion_fix(Path(path), convertible),
            ) from None
        raise bad_argument(
            "model",
            f"a checkpoint multihead reads itself (model_type {' or '.join(map(repr, SERVED_MODEL_TYPES))}), or "
            "transformers installed for any other",
            f"model_type {kind!r} without transformers",
            "pip install 'multihead[hf]'",
        ) from None
    return load_model(path, dtype=dtype)


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The causal language model in folder ``path`` on multihead's kernel, with its tokenizer: a folder written by
    :meth:`multihead.lab.models.Decoder.save` (``multihead train``'s checkpoints, with their symbols), or a
    transformers causal LM (GPT-2, Llama, Mistral, ...; transformers must then be installed). Anything else (an
    encoder, an encoder-decoder) is one error naming ``model``."""
    if not isinstance(path, (str, Path)):
        raise bad_argument("model", "a folder path", repr(path), "pass --model DIR", kind=TypeError)
    if path_kind(Path(path) / DECODER_CONFIG) == "file":
        reader = load_decoder_reader(path, dtype=dtype)
        if reader.tokenizer is None:
            raise bad_argument(
                "model",
                "a decoder saved with its symbols.json (multihead train writes one)",
                f"{str(path)!r} without one",
                "save the model with its tokenizer's symbols",
            )
        return CausalLM(reader.decoder.eval(), reader.tokenizer, reader.name)
    config = _transformers_config(Path(path))  # None for a Seq2Seq.save of ours (its own config file) too
    kind = _model_type(config)
    if kind is None or kind in SERVED_MODEL_TYPES or bool((config or {}).get("is_encoder_decoder")):
        raise bad_argument(
            "model",
            "a causal language model folder (a multihead train induction checkpoint, or a transformers *ForCausalLM)",
            f"{str(path)!r} ({'no causal LM config.json' if kind is None else f'model_type {kind!r}'})",
            "point --model at a decoder: circuits reads the logits of the next token",
        )
    try:
        from multihead.integrations.transformers_models import load_causal_lm as load_transformers_causal_lm
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("transformers"):
            raise
        raise bad_argument(
            "model",
            "transformers installed to read this checkpoint",
            f"model_type {kind!r}",
            "pip install 'multihead[hf]'",
        ) from None
    try:
        return load_transformers_causal_lm(path, dtype=dtype)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise bad_argument(
            "model", "a model_type with a causal LM head", f"model_type {kind!r}", "point --model at a decoder"
        ) from None

"""Any local transformers checkpoint as a :class:`multihead.lab.models.TextEncoder`, on multihead's kernel.

    model = load_model("path/to/checkpoint")      # config.json, weights, tokenizer files
    inspection = multihead.lab.inspect.inspect_text(model, "The bank was full of money.")

:func:`load_model` reads the folder with transformers' ``AutoModel`` and ``AutoTokenizer`` (local files only,
``attn_implementation="multihead"``) and wraps them so every reader of a text model (``inspect_text``,
``head_stats``, the ablation tools, ``multihead inspect --model``) serves it as it serves our own encoder:
:class:`TransformersTokenizer` gives the readers' batches, and the model's attention steps are its
:func:`multihead.lab.inspect.attention_sites` (registered here for the wrapper). An encoder-decoder reads the
text as its source and, unless told otherwise, the same text shifted right as its target (as BART's
denoising does): its parts are "encoder", "decoder" and "cross".

transformers is an optional extra (``pip install 'multihead[hf]'``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from multihead._errors import bad_argument, describe, floating_dtype, whole_sentences
from multihead._userfiles import path_kind
from multihead.attend import AttentionSite, register_site_finder
from multihead.integrations.transformers import IMPLEMENTATION, attention_sites
from multihead.lab.models.contract import CausalLM, TextEncoder
from multihead.lab.models.files import model_folder, reading
from multihead.lab.models.tokenizer import Pieces, TextTokenizer, TokenBatch
from multihead.layer import MultiHeadAttention

__all__ = ["TransformersModel", "TransformersTokenizer", "load_model", "load_causal_lm"]

_FIX = "point --model at a transformers checkpoint folder (config.json, weights, tokenizer files)"
# parameters of the base model that last_hidden_state never reads
_UNREAD = ("pooler.",)
# the files a tokenizer is read from (fast tokenizers, BPE and WordPiece vocabularies, SentencePiece models)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
# every file a tokenizer may be read from, in the order a damaged one is looked for
_TOKENIZER_READ = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)
# the weights files transformers reads (one file, or an index and its shards)
_WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# the position limit of a tokenizer that declares none (transformers' placeholder is about 1e30)
_NO_LIMIT = 1 << 30


class TransformersTokenizer(TextTokenizer):
    """A transformers tokenizer giving the readers' :class:`TokenBatch` es, special tokens included.

    Pieces are shown as the tokenizer decodes each one alone (" bank" for GPT-2's "Ġbank"), stripped;
    ``max_length`` is the model's position limit.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, max_length: int):
        self.hf = tokenizer
        self.max_length = self.sentence_max_length = max_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.bos_id = tokenizer.bos_token_id if isinstance(tokenizer.bos_token_id, int) else None

    @property
    def vocabulary_size(self) -> int:
        return len(self.hf)  # added tokens included

    def piece(self, token_id: int, raw: str | None = None) -> str:
        """How token ``token_id`` is shown: decoded alone and stripped (its raw form if that is blank)."""
        raw = raw if raw is not None else str(self.hf.convert_ids_to_tokens(token_id))
        return str(self.hf.decode([token_id])).strip() or raw

    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts``; a text over ``max_length`` (default the model's limit) raises unless
        ``truncate`` (then it is cut, keeping the tokenizer's closing special token)."""
        limit = self.max_length if max_length is None else max_length
        pretokenized = bool(texts) and not isinstance(texts[0], str)
        # a fast tokenizer says where each piece sits in the text: the words as the tokenizer splits them
        offsets_known = bool(self.hf.is_fast) and not pretokenized
        encoded = self.hf(
            list(texts),
            is_split_into_words=pretokenized,
            add_special_tokens=True,
            return_offsets_mapping=offsets_known,
            return_special_tokens_mask=True,
        )
        rows: list[list[int]] = [list(ids) for ids in encoded["input_ids"]]
        types = encoded.get("token_type_ids")
        type_rows: list[list[int]] = [list(t) for t in types] if types is not None else [[0] * len(r) for r in rows]
        pieces: list[Pieces] = []
        analysed: list[str] = []
        full_lengths = [len(ids) for ids in rows]
        for index, ids in enumerate(rows):
            special = [bool(flag) for flag in encoded["special_tokens_mask"][index]]
            tokenizer_words = (
                list(encoded.word_ids(index)) if encoded.is_fast else [None if flag else 0 for flag in special]
            )
            offsets = list(encoded["offset_mapping"][index]) if offsets_known else [(0, 0)] * len(ids)
            closing = 1 if len(ids) > limit and ids[-1] in self.hf.all_special_ids else 0  # keep a closing special
            rows[index], type_rows[index], special, tokenizer_words, offsets = self._fit(
                texts,
                index,
                [ids, type_rows[index], special, tokenizer_words, offsets],
                limit,
                truncate=truncate,
                closing=closing,
            )
            raw = [str(piece) for piece in self.hf.convert_ids_to_tokens(rows[index])]
            shown = [self.piece(token_id, piece) for token_id, piece in zip(rows[index], raw, strict=True)]
            text = texts[index]
            if offsets_known:
                pieces.append(Pieces.from_offsets(shown, str(text), tokenizer_words, offsets))
            elif pretokenized and encoded.is_fast:  # the words given
                pieces.append(Pieces(shown, tokenizer_words, [str(word) for word in text]))
            else:  # a slow tokenizer: the raw pieces' word markers are all there is
                by_markers = Pieces.from_markers(raw, special=special)
                pieces.append(Pieces(shown, by_markers.word_ids, by_markers.words))
            kept_offsets = (
                [span for span, flag in zip(offsets, special, strict=True) if not flag] if offsets_known else None
            )
            analysed.append(self._analysed(text, kept_offsets, len(rows[index]), full_lengths[index]))
        return self._padded(rows, type_rows, pieces, analysed, full_lengths)


class TransformersModel(TextEncoder):
    """A transformers model running on ``attn_implementation="multihead"``, as a text encoder.

    ``model``: the transformers model (base model: its forward gives ``last_hidden_state``); forward takes
    (b, n) ids, mask and segment ids and returns (b, n, hidden) states (an encoder-decoder's: the decoder's,
    reading the text shifted right). Its attention steps are ``multihead.lab.inspect.attention_sites(wrapper)``.
    """

    described_as = "a transformers checkpoint"

    def __init__(self, model: PreTrainedModel, *, tokenizer: TextTokenizer | None, name: str):
        super().__init__(tokenizer=tokenizer, name=name)
        self.model = model
        self.is_encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.is_causal = not self.is_encoder_decoder and bool(
            getattr(model.config, "is_decoder", False)
            or any(getattr(module, "is_causal", False) for module in model.modules())
        )
        self._takes_types = "token_type_ids" in model.forward.__code__.co_varnames

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        """None of ours: a transformers model's attention steps are its sites."""
        raise bad_argument(
            "model",
            "a model built from multihead.MultiHeadAttention",
            f"a transformers {type(self.model).__name__}",
            "use multihead.lab.inspect.attention_sites(model) for its attention steps",
            kind=TypeError,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, n) token ids, (b, n) mask (1 = real token), (b, n) segment ids -> (b, n, hidden) states."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self._takes_types and token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        if self.is_encoder_decoder:
            inputs["decoder_input_ids"] = self._decoder_ids(input_ids)
        return self.model(**inputs).last_hidden_state

    def _start_id(self) -> int:
        config = self.model.config
        for name in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return 0

    def _decoder_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(b, n) ids of the text -> (b, n) decoder input: the text shifted right after the start token, as
        BART's denoising reads it."""
        shifted = torch.full_like(input_ids, self._start_id())
        shifted[:, 1:] = input_ids[:, :-1]
        return shifted

    def part_pieces(self, batch: TokenBatch, part: str) -> tuple[list[Pieces], list[Pieces]]:
        """For an encoder-decoder, the decoder reads the text shifted right after its start token: "decoder"
        goes from those pieces to themselves, "cross" from them to the text's; otherwise the text's."""
        if not self.is_encoder_decoder or part == "encoder":
            return batch.pieces, batch.pieces
        assert isinstance(self.tokenizer, TransformersTokenizer)
        start = self.tokenizer.piece(self._start_id())
        target = [text.shifted_right(start) for text in batch.pieces]
        return (target, target) if part == "decoder" else (target, batch.pieces)


def _sites(model: object) -> list[AttentionSite] | None:
    return attention_sites(model.model) if isinstance(model, TransformersModel) else None


register_site_finder(_sites)


def _position_limit(config, tokenizer: PreTrainedTokenizerBase) -> int:
    limits = [getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    known = [int(limit) for limit in limits if isinstance(limit, int) and 0 < limit < _NO_LIMIT]
    return min(known) if known else _NO_LIMIT


def _weights_files(folder: Path) -> list[str]:
    """The weights files of ``folder`` transformers may read: the single files and indexes, then any shards."""
    shards = sorted(
        {path.name for pattern in ("*.safetensors", "pytorch_model-*.bin") for path in folder.glob(pattern)}
    )
    return list(dict.fromkeys([*_WEIGHTS_FILES, *shards]))


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> TransformersModel:
    """The transformers checkpoint in folder ``path`` on multihead's kernel, with its tokenizer (eval mode).

    Reads local files only. A folder that is not a checkpoint transformers knows (no config.json, an
    unknown ``model_type``), or has no tokenizer files, is one error saying what is needed.
    """
    model, tokenizer, folder = _load_pretrained(path, dtype, AutoModel)
    return TransformersModel(model, tokenizer=tokenizer, name=folder.name).eval()


def load_causal_lm(path: str | Path, *, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The transformers causal LM in folder ``path`` (``AutoModelForCausalLM``: its LM head included) on
    multihead's kernel, with its tokenizer, in eval mode; refused as :func:`load_model` refuses, and a folder whose
    model_type has no causal LM is one error naming ``model``."""
    model, tokenizer, folder = _load_pretrained(path, dtype, AutoModelForCausalLM)
    return CausalLM(model.eval(), tokenizer, folder.name)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Within: transformers logs errors only and shows no progress bars (the caller's output is a report: no loading
    bars or notes in it); its settings come back after."""
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_pretrained(
    path: str | Path, dtype: torch.dtype, auto_class
) -> tuple[PreTrainedModel, TransformersTokenizer, Path]:
    """The checkpoint in ``path`` through ``auto_class`` on the kernel, its tokenizer, and its folder."""
    floating_dtype("dtype", dtype, allow_none=False)
    folder = model_folder("model", path, what="a model folder", fix=_FIX)
    if path_kind(folder / "config.json") != "file":
        raise bad_argument("model", "a checkpoint folder with a config.json", f"{folder} without one", _FIX)
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise bad_argument("config.json", "a JSON object", "a file that is not one", _FIX) from None
    try:
        with _quiet_transformers():  # its notes on a config (token ids past a tiny vocabulary) are not the report's
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        reason = whole_sentences(str(error)) if str(error).strip() else type(error).__name__
        raise bad_argument(
            "config.json",
            "a model_type this transformers knows (bert, gpt2, llama, mistral, bart, ...)",
            f"model_type {model_type!r} ({reason})",
            "upgrade transformers, or point --model at a supported checkpoint",
        ) from None
    if not any(path_kind(folder / name) == "file" for name in _TOKENIZER_FILES):  # transformers would make an empty one
        raise bad_argument(
            "model",
            f"a checkpoint folder with its tokenizer files (one of {', '.join(_TOKENIZER_FILES)})",
            f"{folder} without any",
            "save the tokenizer into the folder (tokenizer.save_pretrained(folder))",
        )
    with reading(folder, _TOKENIZER_READ, what="a tokenizer file transformers can read"), _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with reading(folder, _weights_files(folder), what="a weights file transformers can read"), _quiet_transformers():
        model, loading = auto_class.from_pretrained(
            folder,
            config=config,
            attn_implementation=IMPLEMENTATION,
            local_files_only=True,
            dtype=dtype,
            output_loading_info=True,
            # transformers would raise on a shape that config.json does not give, pointing at a report it logs
            # (silenced here): loaded, the mismatches are named below in one line
            ignore_mismatched_sizes=True,
        )
    # a pooler (BERT's [CLS] head) is absent from an MLM save and unused by the states we read: not missing
    missing = sorted(str(key) for key in loading.get("missing_keys", []) if not str(key).startswith(_UNREAD))
    mismatched = sorted(
        (str(key), tuple(saved), tuple(wanted)) for key, saved, wanted in loading.get("mismatched_keys", [])
    )
    if missing or mismatched:  # transformers would fill them with random values: a model that only looks loaded
        parts = []
        if mismatched:
            key, saved, wanted = mismatched[0]
            parts.append(
                f"{len(mismatched)} of another shape (first: {key!r} of shape {saved} in the weights, "
                f"{wanted} from config.json)"
            )
        if missing:
            parts.append(f"{len(missing)} missing (first: {missing[0]!r})")
        raise bad_argument(
            "model",
            f"weights for every parameter of the {config.model_type} model config.json describes, of its shape",
            f"{' and '.join(parts)} in {folder}",
            "check that config.json belongs to these weights, or save the model again",
        )
    if not isinstance(model, PreTrainedModel):  # pragma: no cover - AutoModel always gives one
        raise bad_argument("model", "a transformers model", describe(model), _FIX, kind=TypeError)
    return model, TransformersTokenizer(tokenizer, max_length=_position_limit(config, tokenizer)), folder

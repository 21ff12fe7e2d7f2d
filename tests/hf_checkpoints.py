"""Tiny Hugging Face checkpoints written to local folders: random weights, tokenizers trained in memory.

Nothing is downloaded: configs are built in code, tokenizers trained with the ``tokenizers`` library on a
few sentences, and both saved with ``save_pretrained`` the way a user's checkpoint folder is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from hf_tiny import tiny_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = [
    "The bank was full of money.",
    "The river bank was muddy after the rain.",
    "She sat on the bank of the river and read a book.",
    "Money does not grow on trees, he said.",
]
ARCHITECTURES = ("bert", "gpt2", "llama", "bart")


def _wordpiece() -> transformers.PreTrainedTokenizerFast:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(SENTENCES * 4, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def byte_bpe(
    bos: str, eos: str, pad: str, *, wrap: bool, sentences: Sequence[str] = SENTENCES
) -> transformers.PreTrainedTokenizerFast:
    """GPT-2's byte-level BPE (no prefix space) trained on ``sentences``; with ``wrap``, <s> text </s> (BART)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys([pad, bos, eos]))
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(list(sentences) * 4, trainer)
    if wrap:  # <s> text </s>, as BART's tokenizer does
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}",
            special_tokens=[(bos, tokenizer.token_to_id(bos)), (eos, tokenizer.token_to_id(eos))],
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad)


def _sentencepiece_bpe() -> transformers.PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE: spaces become "\u2581" in the normalizer, no pre-tokenizer (the
    whole text is one pre-token), bytes the vocabulary lacks fall back to <0xNN> pieces."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    # trained on words (as SentencePiece merges within words), then read whole, as Llama's tokenizer.json does
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    spec = json.loads(tokenizer.to_str())
    spec["pre_tokenizer"] = None
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def _unigram() -> transformers.PreTrainedTokenizerFast:
    """A T5-style SentencePiece Unigram: a "\u2581"-prefixed piece begins each white-space word; </s> closes."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


# one tokenizer of each family, as its checkpoints' tokenizer.json builds it
TOKENIZER_FAMILIES = ("wordpiece", "byte_bpe", "sentencepiece_bpe", "unigram")


def tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer of ``family`` (one of TOKENIZER_FAMILIES): BERT's WordPiece, GPT-2's byte-level BPE,
    Llama-2's SentencePiece BPE with byte fallback, T5's SentencePiece Unigram."""
    if family == "wordpiece":
        return _wordpiece()
    if family == "byte_bpe":
        return byte_bpe("<|endoftext|>", "<|endoftext|>", "<|endoftext|>", wrap=False)
    if family == "sentencepiece_bpe":
        return _sentencepiece_bpe()
    if family == "unigram":
        return _unigram()
    raise AssertionError(family)


def build(name: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerFast]:
    """A random tiny model of architecture ``name`` (one of ARCHITECTURES) and its tokenizer."""
    torch.manual_seed(0)
    if name == "bert":
        tokenizer = _wordpiece()
        config = transformers.BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
        )
        return transformers.BertForMaskedLM(config), tokenizer  # a save with its MLM head (cls.predictions.*)
    if name == "gpt2":
        tokenizer = byte_bpe("<|endoftext|>", "<|endoftext|>", "<|endoftext|>", wrap=False)
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = transformers.GPT2Config(
            vocab_size=len(tokenizer), n_embd=24, n_layer=2, n_head=4, n_positions=64, **ids
        )
        return transformers.GPT2LMHeadModel(config), tokenizer
    if name == "llama":
        tokenizer = byte_bpe("<s>", "</s>", "<pad>", wrap=False)
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            max_position_embeddings=64,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return transformers.LlamaForCausalLM(config), tokenizer
    if name == "bart":
        tokenizer = byte_bpe("<s>", "</s>", "<pad>", wrap=True)
        config = transformers.BartConfig(
            vocab_size=len(tokenizer),
            d_model=24,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.eos_token_id,
        )
        return transformers.BartForConditionalGeneration(config), tokenizer
    if name == "gpt_oss":  # learned sinks: head 0 of each layer parks its weight on its sink, the others keep theirs
        tokenizer = byte_bpe("<s>", "</s>", "<pad>", wrap=False)
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        config = tiny_config("gpt_oss", vocab_size=len(tokenizer), max_position_embeddings=64, **ids)
        config.pad_token_id = tokenizer.pad_token_id
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor([8.0] + [-8.0] * (config.num_attention_heads - 1)))
        return model, tokenizer
    if name == "qwen3_next":  # a hybrid: linear-attention layers 0 and 2, attention layers 1 and 3
        tokenizer = byte_bpe("<s>", "</s>", "<pad>", wrap=False)
        ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
        config = tiny_config("qwen3_next", vocab_size=len(tokenizer), num_hidden_layers=4, layer_types=kinds, **ids)
        config.pad_token_id = tokenizer.pad_token_id
        return transformers.Qwen3NextForCausalLM(config), tokenizer
    raise AssertionError(name)


def save(name: str, folder: Path) -> Path:
    """Write checkpoint ``name`` (model and tokenizer) into ``folder``; returns the folder."""
    model, tokenizer = build(name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

"""Hugging Face models with attn_implementation="multihead" against transformers' own attention.

Tiny randomly initialised models, built in memory from their configs (nothing is downloaded). BERT and
GPT-2's eager attention computes in the model's dtype, so in float64 it is the oracle; Llama's and
Mistral's eager softmax runs in float32 whatever the dtype, so in float64 they are compared with
transformers' "sdpa" (float64 throughout) and in float32 with "eager".

The tests that run a model are portable: both models and their inputs live on the --device; the checks of
transformers' internals and versions, and the real MiniLM checkpoint, stay on the CPU.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the test extra installs it; the package itself never needs it

import multihead
import multihead.attend
from multihead._errors import InputError
from multihead.integrations import TRANSFORMERS_TESTED, UnsupportedTransformersError
from multihead.integrations import transformers as integration
from multihead.integrations import transformers_internals as internals
from multihead.integrations.transformers_internals import attn_implementation
from multihead.integrations.transformers_masks import typed_mask

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders and in-memory configs only, never the hub

VOCAB = 97
BATCH, LENGTH = 2, 9


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if name == "bert":
        config = transformers.BertConfig(
            hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, **common
        )
        return transformers.BertModel(config)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=24, n_layer=2, n_head=4, **common))
    if name == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, **common
        )
        return transformers.GPTNeoXForCausalLM(config)
    # grouped-query attention (4 query heads over 2 key/value heads) and RoPE; Mistral adds a window of 3 keys
    decoder = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 40,
        **common,
    }
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder))
    if name == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=3, **decoder))
    if name == "qwen2":  # biases on q, k and v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
    raise AssertionError(name)


# architecture -> the implementation that is exact in float64
ORACLE = {"bert": "eager", "gpt2": "eager", "llama": "sdpa", "mistral": "sdpa"}


def twins(
    model: torch.nn.Module, dtype: torch.dtype, reference: str = "eager", device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, ...]:
    """(``model`` on transformers' ``reference`` implementation, a copy with the same weights on ours), in eval
    mode, ``dtype`` and on ``device``."""
    theirs = model.to(device=device, dtype=dtype).eval()
    theirs.set_attn_implementation(reference)
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def pair(
    name: str, dtype: torch.dtype, reference: str, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, ...]:
    return twins(build(name), dtype, reference, device)


def inputs(padded: bool, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """input_ids and attention_mask (BATCH, LENGTH), drawn on the CPU, on ``device``."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0  # right padding on the second row
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def target_ids(seed: int, device: torch.device | str) -> torch.Tensor:
    """Decoder input ids or labels (BATCH, 5), drawn on the CPU, on ``device``."""
    return torch.randint(3, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(seed)).to(device)


def first_output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.portable
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(ORACLE))
def test_forward_matches_transformers_own_attention(name, dtype, padded, device):
    reference = ORACLE[name] if dtype == torch.float64 else "eager"
    theirs, ours = pair(name, dtype, reference, device)
    batch = inputs(padded, device)
    with torch.no_grad():
        expected, got = first_output(theirs, batch), first_output(ours, batch)
    real = batch["attention_mask"].bool()  # positions of padding tokens are not compared (their rows are arbitrary)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got[real], expected[real], atol=tolerance, rtol=tolerance)


def kernel_calls(monkeypatch) -> list[tuple[torch.Size, torch.Size]]:
    """(query shape, key shape) of every multihead.attention call the integration makes from now on."""
    calls = []
    original = multihead.attend.attention_result

    def recording(q, k, v, **options):
        calls.append((q.shape, k.shape))
        return original(q, k, v, **options)

    monkeypatch.setattr(multihead.attend, "attention_result", recording)  # where every step calls the kernel
    return calls


@pytest.mark.portable
def test_the_kernel_really_runs(monkeypatch, device):
    calls = kernel_calls(monkeypatch)
    _, ours = pair("llama", torch.float32, "eager", device)
    with torch.no_grad():
        first_output(ours, inputs(padded=True, device=device))
    # two layers, query (b, h, i, d) with the 4 query heads; keys went in as 2 heads, never repeated
    assert calls == [(torch.Size([BATCH, 4, LENGTH, 8]), torch.Size([BATCH, 2, LENGTH, 8]))] * 2


@pytest.mark.portable
def test_training_gradients_match_eager(device):
    theirs, ours = pair("gpt2", torch.float64, "eager", device)
    theirs.train(), ours.train()
    for model in (theirs, ours):  # dropout off: the same function, in training mode
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    batch = inputs(padded=True, device=device)
    for model in (theirs, ours):
        model(**batch, labels=batch["input_ids"]).loss.backward()
    for (name, expected), got in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.portable
def test_weights_asked_for_are_the_kernels_and_match_eager(device):
    theirs, ours = pair("bert", torch.float64, "eager", device)
    batch = inputs(padded=True, device=device)
    with torch.no_grad():
        expected = theirs(**batch, output_attentions=True).attentions
        got = ours(**batch, output_attentions=True).attentions
    assert len(got) == 2
    for layer_got, layer_expected in zip(got, expected, strict=True):
        torch.testing.assert_close(layer_got, layer_expected, atol=1e-12, rtol=0)


@pytest.mark.portable
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_with_the_models_own_cache_gives_the_same_tokens(name, device):
    theirs, ours = pair(name, torch.float64, ORACLE[name], device)
    prompt = inputs(padded=False, device=device)["input_ids"][:1, :5]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    expected = theirs.generate(prompt, **settings)
    got = ours.generate(prompt, **settings)
    assert torch.equal(got, expected)
    assert got.shape[1] == 13


def generating_model(name: str) -> torch.nn.Module:
    """A tiny model of ``name`` that generates: build()'s decoders, and BART (its decoder generates)."""
    return build_bart() if name == "bart" else build(name)


@pytest.mark.portable
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gpt_neox", "bart"])
def test_static_cache_generation_matches_transformers_own_attention(name, device):
    """generate builds a static cache's mask once and hands it back to the model as its attention_mask; ours
    is a typed mask, which transformers' mask code used to refuse (AttributeError: no attribute 'ndim')."""
    theirs, ours = twins(generating_model(name), torch.float64, "sdpa", device)
    prompt = inputs(padded=False, device=device)
    ids, mask = prompt["input_ids"][:, :6], prompt["attention_mask"][:, :6].clone()
    if name != "bart":  # left padding for the decoders, as generate wants it
        mask[1, :2] = 0
    settings = {
        "attention_mask": mask,
        "max_new_tokens": 4,
        "do_sample": False,
        "pad_token_id": 0,
        "cache_implementation": "static",
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    expected, got = theirs.generate(ids, **settings), ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=1e-10, rtol=0)


@pytest.mark.portable
def test_block_indices_without_a_block_size_are_refused_not_guessed(device):
    q, k, v = (torch.randn(1, h, 3, 8).to(device) for h in (4, 2, 2))
    module = torch.nn.Linear(1, 1, device=device)  # stands for the model's attention module: its class is named
    picks = torch.zeros(1, 1, 3, 1, dtype=torch.long, device=device)
    fragment = r"attn_implementation='multihead': expected a Linear whose indexer says its key blocks' size"
    with pytest.raises(ValueError, match=fragment + r".*Fix: load"):
        integration.attention_forward(module, q, k, v, None, block_indices=picks)


@pytest.mark.portable
def test_sinks_and_picked_keys_reach_the_kernel(device):
    """s_aux (an (h,) parameter), sinks (Inkling 2's (b, h, i, 1) column) and indices each change the output."""
    q, k, v = (torch.randn(1, h, 3, 8).to(device) for h in (4, 2, 2))
    module = torch.nn.Linear(1, 1, device=device)
    plain, _ = integration.attention_forward(module, q, k, v, None)
    with_sinks, _ = integration.attention_forward(module, q, k, v, None, s_aux=torch.ones(4, device=device))
    per_row, _ = integration.attention_forward(module, q, k, v, None, sinks=torch.ones(1, 4, 3, 1, device=device))
    torch.testing.assert_close(with_sinks, per_row)
    lse = multihead.attention_result(q, k, v, return_lse=True).lse
    torch.testing.assert_close(with_sinks, plain * torch.sigmoid(lse - 1).transpose(1, 2)[..., None])
    first_key_only = torch.zeros(1, 3, 1, dtype=torch.int32, device=device)
    picked, _ = integration.attention_forward(module, q, k, v, None, indices=first_key_only)
    torch.testing.assert_close(picked, v[:, [0, 0, 1, 1], :1].expand(1, 4, 3, 8).transpose(1, 2))


def current(module: str):
    """The module ``import`` gives now (transformers 5.4 puts a new top-level module in sys.modules once a model is
    built, so a reference taken at collection may no longer be the one the integration imports)."""
    return importlib.import_module(module)


def reimport_without(monkeypatch, change) -> BaseException:
    """The error importing the integration anew raises after ``change(monkeypatch)`` broke transformers; every
    module of the integration (and the change) is restored after the test."""
    change(monkeypatch)
    kept = "multihead.integrations.transformers_versions"  # the error's class: the one caught by name
    prefix = "multihead.integrations.transformers"
    for name in [name for name in sys.modules if name.startswith(prefix) and name != kept]:
        monkeypatch.delitem(sys.modules, name)  # imported again below, then put back as it was
    with pytest.raises(ImportError) as raised:
        importlib.import_module("multihead.integrations.transformers")
    return raised.value


def _old_mask_call(monkeypatch):
    def sdpa_mask(batch_size, cache_position, kv_length, kv_offset=0, **kwargs):  # transformers 5.0 to 5.3's
        raise AssertionError("never called")

    monkeypatch.setattr(current("transformers.masking_utils"), "sdpa_mask", sdpa_mask)


def _closure_changed(monkeypatch):
    monkeypatch.setattr(
        current("transformers.masking_utils"), "sliding_window_overlay", lambda size: lambda b, h, q, kv: kv > q - size
    )


@pytest.mark.parametrize(
    "change, what",
    [
        (
            lambda mp: mp.delattr(current("transformers.masking_utils"), "bidirectional_mask_function"),
            "whose transformers.masking_utils has no bidirectional_mask_function",
        ),
        (
            lambda mp: mp.delattr(current("transformers.masking_utils"), "sdpa_mask"),
            "whose transformers.masking_utils has no sdpa_mask",
        ),
        (
            # None stands for a transformers without it: its lazy top-level module would find a deleted name again
            lambda mp: mp.setattr(current("transformers"), "AttentionMaskInterface", None),
            "which has no transformers.AttentionMaskInterface",
        ),
        (
            _old_mask_call,
            "whose transformers.masking_utils.sdpa_mask (the mask interface's call) takes no q_length",
        ),
        (
            _closure_changed,
            "whose transformers.masking_utils.sliding_window_overlay no longer builds "
            "sliding_window_overlay.<locals>.inner_mask over 'sliding_window'",
        ),
    ],
    ids=["a mask function", "sdpa_mask", "the mask interface", "the mask call's signature", "a factory's closure"],
)
def test_a_transformers_without_an_internal_we_rely_on_is_one_line_naming_the_tested_range(monkeypatch, change, what):
    error = reimport_without(monkeypatch, change)
    assert isinstance(error, UnsupportedTransformersError) and isinstance(error, InputError)
    message = str(error)
    oldest, newest = TRANSFORMERS_TESTED
    assert len(message.splitlines()) == 1
    assert message == (
        f"transformers: expected a version multihead's integration is tested on ({oldest} to {newest}), got "
        f"transformers {transformers.__version__}, {what}. Fix: pip install 'transformers>={oldest},<={newest}'"
    )


def test_transformers_internals_are_imported_in_one_place_and_all_checked():
    """Only transformers_internals imports transformers.masking_utils, and it checks every name it imports."""
    source = Path(internals.__file__).parent.parent
    importers = []
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "transformers.masking_utils":
                importers.append(path.name)
                assert {alias.name for alias in node.names} == set(internals.MASKING_NAMES)
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "transformers"
                and path.name != "transformers_internals.py"
            ):
                names = {alias.name for alias in node.names}
                assert not names & {*internals.TOP_LEVEL_NAMES, "masking_utils"}, path
            if isinstance(node, ast.Attribute) and node.attr == "masking_utils":
                importers.append(path.name)
    assert importers == ["transformers_internals.py"]
    # the signature checked is the one typed_mask takes (besides **kwargs, passed on to sdpa_mask)
    taken = [name for name, p in inspect.signature(typed_mask).parameters.items() if p.kind != p.VAR_KEYWORD]
    assert taken == list(internals.SDPA_MASK_PARAMETERS)
    oldest, newest = (tuple(int(part) for part in version.split(".")) for version in TRANSFORMERS_TESTED)
    assert oldest <= newest


def test_the_real_minilm_on_our_kernel_gives_sentence_transformers_embeddings():
    from sentence_transformers import SentenceTransformer

    from multihead.lab.models import find_model_dir

    sentences = [
        "The bank was full of money.",
        "We sat on the river bank.",
        "A short one.",
        "Attention is all you need, said the paper, and the field listened for years afterwards.",
    ]
    folder = str(find_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder, attn_implementation=integration.IMPLEMENTATION).eval()
    assert attn_implementation(model.config) == integration.IMPLEMENTATION  # the one private read, in one place
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state  # (b, n, 384)
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    ours = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)  # mean pooling, unit norm
    reference = SentenceTransformer(folder, device="cpu").encode(sentences, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min() >= 0.99999
    assert (ours - reference).abs().max() <= 1e-5


def build_bart() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=24,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(config)


@pytest.mark.portable
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_an_encoder_decoder_with_cross_attention_matches_eager(dtype, monkeypatch, device):
    theirs, ours = twins(build_bart(), dtype, device=device)
    batch = inputs(padded=True, device=device)  # padded source: the cross-attention's keys are masked on row 2
    target = target_ids(2, device)
    calls = kernel_calls(monkeypatch)
    with torch.no_grad():
        expected = theirs(**batch, decoder_input_ids=target).logits
        got = ours(**batch, decoder_input_ids=target).logits
    # encoder self-attention 9 x 9, decoder self-attention 5 x 5, cross-attention 5 queries x 9 source keys
    assert sorted({(q[2], k[2]) for q, k in calls}) == [(5, 5), (5, LENGTH), (LENGTH, LENGTH)]
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def build_t5() -> torch.nn.Module:
    """T5: a learned relative position bias per head (in the first layer of each stack, reused by the others),
    no score scaling, cross-attention with its own bias."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=24,
        d_kv=6,
        d_ff=32,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,  # training mode, same function: T5 passes its rate to the attention call itself
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():  # a bias near 0 would hide a bias dropped: make it count
        for module in model.modules():
            if getattr(module, "has_relative_attention_bias", False):
                module.relative_attention_bias.weight.normal_(0.0, 2.0)
    return model


@pytest.mark.portable
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_t5_relative_position_bias_matches_eager(dtype, padded, monkeypatch, device):
    theirs, ours = twins(build_t5(), dtype, device=device)
    batch = inputs(padded, device)
    target = target_ids(2, device)
    calls = kernel_calls(monkeypatch)
    with torch.no_grad():
        expected = theirs(**batch, decoder_input_ids=target).logits
        got = ours(**batch, decoder_input_ids=target).logits
    assert len(calls) == 6  # encoder self, decoder self and cross, two layers each
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.portable
def test_t5_training_gradients_reach_the_bias_table_and_generate_matches_eager(device):
    theirs, ours = twins(build_t5(), torch.float64, device=device)  # put in training mode below
    batch = inputs(padded=True, device=device)
    labels = target_ids(3, device)
    for model in (theirs, ours):  # dropout_rate 0: training mode computes the same function
        model.train()
        model(**batch, labels=labels).loss.backward()
    for (name, expected), got in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-10, rtol=1e-8, msg=name)
    bias_grads = [p.grad for n, p in ours.named_parameters() if "relative_attention_bias" in n]
    assert len(bias_grads) == 2 and all(g.abs().sum() > 0 for g in bias_grads)
    settings = {"max_new_tokens": 6, "do_sample": False}
    prompt = inputs(padded=False, device=device)["input_ids"][:1]
    assert torch.equal(ours.eval().generate(prompt, **settings), theirs.eval().generate(prompt, **settings))


def build_gemma2(softcap: float | None = 2.0) -> torch.nn.Module:
    """Gemma 2: logit soft-capping in every layer, a sliding window of 3 keys in every other one, GQA."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=40,
        sliding_window=3,
        attn_logit_softcapping=softcap,  # small, so that capping changes the scores a lot
        query_pre_attn_scalar=8,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():  # random init gives scores near 0, where the cap is the identity: make them large
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(30.0)
    return model


# In float64 with padding, Gemma 2's eager attention (like Mistral's) turns a padded row whose window holds only
# padding into NaN, which the next layer spreads through the text: padding is compared in float32, where it does not
@pytest.mark.portable
@pytest.mark.parametrize(
    "dtype, padded",
    [(torch.float64, False), (torch.float32, False), (torch.float32, True)],
    ids=["float64-full", "float32-full", "float32-padded"],
)
def test_gemma2_soft_capping_and_window_match_eager(dtype, padded, monkeypatch, device):
    theirs, ours = twins(build_gemma2(), dtype, device=device)
    batch = inputs(padded, device)
    calls = kernel_calls(monkeypatch)
    with torch.no_grad():
        expected, got = theirs(**batch).logits, ours(**batch).logits
    assert len(calls) == 2
    real = batch["attention_mask"].bool()
    # Gemma 2's eager softmax runs in float32 whatever the dtype: float64 agrees to float32 rounding
    tolerance = 1e-6 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got[real], expected[real], atol=tolerance, rtol=tolerance)
    uncapped = copy.deepcopy(ours)
    for module in uncapped.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
    with torch.no_grad():
        assert (uncapped(**batch).logits - got)[real].abs().max() > 1e-3  # the cap really changes the result


@pytest.mark.portable
def test_gemma2_training_gradients_and_generate_match_eager(device):
    theirs, ours = twins(build_gemma2(), torch.float64, device=device)  # put in training mode below
    batch = inputs(padded=False, device=device)  # float64 with padding is NaN on eager's side (see above)
    for model in (theirs, ours):
        model.train()
        model(**batch, labels=batch["input_ids"]).loss.backward()
    for (name, expected), got in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-6, rtol=1e-5, msg=name)
    prompt = inputs(padded=False, device=device)["input_ids"][:1, :5]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.eval().generate(prompt, **settings), theirs.eval().generate(prompt, **settings))


@pytest.mark.portable
@pytest.mark.parametrize("name", ["t5", "gemma2"])
def test_fullgraph_compiled_generation_matches_eager(name, device):
    """Static-cache generate under CompileConfig(fullgraph=True): T5's bias and Gemma 2's soft-cap join the mask
    with masks.all_of (dynamo refuses `mask & tensor`), and auto reads its policy from plain dicts (dynamo
    refuses a mappingproxy once the model's forward has mutated a dict)."""
    theirs, ours = twins(build_t5() if name == "t5" else build_gemma2(), torch.float64, device=device)
    compiled = transformers.CompileConfig(fullgraph=True, backend="eager")  # dynamo's whole-graph trace, no codegen
    compiled._compile_all_devices = True  # transformers compiles on accelerators only unless told so
    prompt = inputs(padded=False, device=device)["input_ids"][:, :5]
    settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "output_scores": True}
    settings["return_dict_in_generate"] = True
    torch._dynamo.reset()
    got = ours.generate(prompt, cache_implementation="static", compile_config=compiled, **settings)
    expected = theirs.generate(prompt, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    tolerance = 1e-10 if name == "t5" else 1e-6  # Gemma 2's eager softmax runs in float32
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), atol=tolerance, rtol=0)


@pytest.mark.portable
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_weights_asked_for_through_the_config_come_back(name, device):
    """A config built with output_attentions=True asks every call for the weights, as eager answers it: one tensor
    per layer, the kernel's, equal to eager's (issue 31: they came back empty, and GPT-2's assisted decoding then
    raised IndexError)."""
    model = build(name)
    # a config made with output_attentions=True, as a user writes LlamaConfig(..., output_attentions=True)
    # (transformers refuses to set it on a config whose implementation is already another than eager)
    config = type(model.config).from_dict({**model.config.to_dict(), "output_attentions": True})
    models = []
    for implementation in ("eager", integration.IMPLEMENTATION):
        twin = type(model)._from_config(config, attn_implementation=implementation, dtype=torch.float64)
        twin.load_state_dict(model.state_dict())
        models.append(twin.to(device).eval())
    theirs, ours = models
    batch = inputs(padded=True, device=device)
    with torch.no_grad():
        expected, got = theirs(**batch).attentions, ours(**batch).attentions
    assert got is not None and len(got) == len(expected) == 2
    for layer_got, layer_expected in zip(got, expected, strict=True):
        torch.testing.assert_close(layer_got, layer_expected, atol=1e-12, rtol=0)


def test_a_compiled_model_does_not_recompile_when_another_model_runs_or_is_freed():
    """Each attention module's seam lives on the module, so a compiled model's graph guards on nothing another
    model changes (issue 31: a module-level weak dictionary was looked up inside the compiled code, and running or
    freeing any other model recompiled it)."""
    import gc

    first = pair("llama", torch.float32, "sdpa")[1]
    compiled = torch.compile(first, backend="eager")
    ids = inputs(padded=False)["input_ids"]
    with torch.no_grad():
        expected = compiled(ids).logits
        other = pair("llama", torch.float32, "sdpa")[1]
        other(ids)
        del other
        gc.collect()
        with torch.compiler.set_stance("fail_on_recompile"):
            torch.testing.assert_close(compiled(ids).logits, expected)


# the parameters every attention function takes by name (attention_forward's own)
NAMED = {"module", "query", "key", "value", "attention_mask", "dropout", "scaling"}


def attention_keywords() -> dict[str, set[str]]:
    """keyword -> the model types whose attention is called with it, or whose eager attention function takes it,
    over every modeling file of the installed transformers."""
    found: dict[str, set[str]] = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.FunctionDef) and node.name == "eager_attention_forward":
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
            elif isinstance(node, ast.Call):
                fn = node.func
                called = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
                if called in ("attention_interface", "eager_attention_forward"):
                    names = [kw.arg for kw in node.keywords if kw.arg]
            for name in names:
                found.setdefault(name, set()).add(path.parent.name)
    return found


def test_every_attention_keyword_of_the_installed_transformers_is_served_or_carried():
    """A keyword neither served nor known to change nothing would be refused at run time (or, before, dropped)."""
    found = attention_keywords()
    assert {"s_aux", "indices", "softcap", "position_bias"} <= set(found)  # the walk reads what it should
    known = NAMED | integration.KEYWORDS_SERVED | integration.KEYWORDS_CARRIED
    unknown = {name: sorted(models)[:3] for name, models in found.items() if name not in known}
    assert not unknown, f"attention keywords multihead neither serves nor carries: {unknown}"


@pytest.mark.portable
def test_a_tensor_keyword_neither_served_nor_carried_is_refused(device):
    q, k, v = (torch.randn(1, h, 3, 8).to(device) for h in (4, 2, 2))
    module = torch.nn.Linear(1, 1, device=device)
    with pytest.raises(ValueError, match=r"Linear passes 'score_scale', which it does not.*got a score_scale tensor"):
        integration.attention_forward(module, q, k, v, None, score_scale=torch.ones(4, device=device))
    out, _ = integration.attention_forward(module, q, k, v, None, position_ids=torch.arange(3, device=device))
    assert out.shape == (1, 3, 4, 8)

"""capture() on Hugging Face models running attn_implementation="multihead".

The weights recorded must be transformers' own (its eager output_attentions, in float64), come from the
same kernel call as the output (one call per layer, asked for the selection), follow the model's layer_idx,
and keep cross-attention apart. Tiny random models built in memory; nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch

import multihead.attend
from multihead.functional import WeightSelection
from multihead.heads import make_ablation
from multihead.integrations import transformers as integration
from multihead.lab.inspect import attention_sites, capture
from test_integrations_transformers import BATCH, LENGTH, VOCAB, build, build_bart, inputs


def pair(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager, multihead) copies of ``model`` in float64, in eval mode."""
    theirs = model.to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def kernel_requests(monkeypatch) -> list[object]:
    """What every kernel call of every attention step was asked to return, from now on."""
    asked = []
    original = multihead.attend.attention_result

    def recording(q, k, v, **options):
        asked.append(options.get("return_weights", False))
        return original(q, k, v, **options)

    monkeypatch.setattr(multihead.attend, "attention_result", recording)
    return asked


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "mistral"])
def test_recorded_weights_are_transformers_own_from_the_same_call(name, monkeypatch):
    theirs, ours = pair(build(name))
    # Mistral's eager attention turns a padded query row whose window holds only padding into NaN in float64, which
    # the next layer spreads through the whole text (ours gives that row eager's float32 result, uniform weights):
    # compare it on an unpadded batch
    batch = inputs(padded=name != "mistral")
    with torch.no_grad():
        expected = theirs(**batch, output_attentions=True).attentions  # per layer (b, h, i, j)
    asked = kernel_requests(monkeypatch)
    with torch.no_grad(), capture(ours, layers=[1], heads=[0, 3]) as rec:
        plain = ours(**batch)
    # one kernel call per layer: the recorded layer asked that very call for its two heads, the other for nothing
    assert asked == [False, WeightSelection(heads=[0, 3], queries=None)]
    assert rec.part == "self" and rec.layers == [1]
    real = batch["attention_mask"].bool()  # padded query rows differ between implementations; real ones may not
    # Llama's and Mistral's eager softmax runs in float32 whatever the model's dtype: 1e-7 apart from float64
    tolerance = 1e-12 if name in ("bert", "gpt2") else 1e-6
    for position, head in enumerate([0, 3]):
        got = rec.weights(1, head)  # (b, i, j)
        torch.testing.assert_close(got[real], expected[1][:, head][real], atol=tolerance, rtol=0)
        torch.testing.assert_close(rec.weights(1)[:, position], got)
    with torch.no_grad():
        again = ours(**batch)
    first = plain.logits if hasattr(plain, "logits") else plain.last_hidden_state
    second = again.logits if hasattr(again, "logits") else again.last_hidden_state
    torch.testing.assert_close(first, second, atol=0, rtol=0)  # recording never changes the output


def test_grouped_heads_record_the_key_value_head_they_read():
    _, ours = pair(build("llama"))  # 4 query heads over 2 key/value heads
    sites = attention_sites(ours)
    assert [(s.part, s.index, s.num_heads, s.num_kv_heads) for s in sites] == [("self", 0, 4, 2), ("self", 1, 4, 2)]
    assert [s.name for s in sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with torch.no_grad(), capture(ours, layers=[0], qkv=True, outputs=True) as rec:
        ours(**inputs(padded=False))
    assert rec.q(0).shape == (BATCH, 4, LENGTH, 8) and rec.k(0).shape == (BATCH, 4, LENGTH, 8)
    torch.testing.assert_close(rec.k(0, 3), rec.k(0, 2))  # heads 2 and 3 share key/value head 1
    assert not torch.equal(rec.k(0, 1), rec.k(0, 2))
    # each head's output is its weights times the values it reads
    torch.testing.assert_close(rec.outputs(0, 3), rec.weights(0, 3) @ rec.v(0, 3), atol=1e-12, rtol=0)


def test_a_decoders_weights_show_the_causal_structure():
    _, ours = pair(build("gpt2"))
    with torch.no_grad(), capture(ours) as rec:
        ours(**inputs(padded=False))
    weights = rec.weights(0)  # (b, h, i, i)
    future = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
    assert (weights[..., future] == 0).all() and (weights[..., ~future] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(BATCH, 4, LENGTH, dtype=torch.float64))


def test_an_encoder_decoder_is_recorded_part_by_part():
    theirs, ours = pair(build_bart())
    batch = inputs(padded=True)
    target = torch.randint(3, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(**batch, decoder_input_ids=target, output_attentions=True)
    parts = [(s.part, s.index) for s in attention_sites(ours)]
    assert parts == [("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1), ("cross", 0), ("cross", 1)]
    recorders = {part: capture(ours, part=part) for part in ("encoder", "decoder", "cross")}
    with torch.no_grad(), recorders["encoder"], recorders["decoder"], recorders["cross"]:
        ours(**batch, decoder_input_ids=target)
    assert capture(ours).part == "encoder"  # the default: the model's first part
    oracle = {
        "encoder": expected.encoder_attentions,
        "decoder": expected.decoder_attentions,
        "cross": expected.cross_attentions,
    }
    shapes = {"encoder": (LENGTH, LENGTH), "decoder": (5, 5), "cross": (5, LENGTH)}  # cross: target x source
    real_keys = batch["attention_mask"].bool()[:, None, None, :]
    for part, rec in recorders.items():
        for layer in (0, 1):
            got, want = rec.weights(layer), oracle[part][layer]
            assert got.shape[-2:] == shapes[part]
            if part == "encoder":  # real query rows only: padded rows differ between implementations
                real = batch["attention_mask"].bool()  # (b, i)
                got, want = got.transpose(1, 2)[real], want.transpose(1, 2)[real]  # (real rows, h, j)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert (recorders["cross"].weights(0).masked_select(~real_keys) == 0).all()  # padded source keys get 0


def test_cached_generation_is_recorded_step_by_step():
    _, ours = pair(build("llama"))
    prompt = inputs(padded=False)["input_ids"][:1]
    with torch.no_grad(), capture(ours, layers=[1], heads=[2]) as rec:
        ours.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert rec.calls(1) == 3  # the prompt, then one call per new token after the first
    assert rec.weights(1, 2, call=0).shape == (1, LENGTH, LENGTH)
    assert rec.weights(1, 2, call=-1).shape == (1, 1, LENGTH + 2)  # one query over the cache


def test_head_surgery_acts_through_the_same_step():
    _, ours = pair(build("bert"))
    batch = inputs(padded=False)
    site = attention_sites(ours)[0]
    with torch.no_grad():
        plain = ours(**batch).last_hidden_state
        site.attend.head_gate = torch.ones(4, dtype=torch.float64)
        gated = ours(**batch).last_hidden_state
        site.attend.head_ablation = make_ablation(4, 6, [1], "zero", None)
        ablated = ours(**batch).last_hidden_state
        with capture(ours, layers=[0], outputs=True) as rec:
            ours(**batch)
        site.attend.head_gate = site.attend.head_ablation = None
        restored = ours(**batch).last_hidden_state
    torch.testing.assert_close(gated, plain, atol=0, rtol=0)
    assert not torch.allclose(ablated, plain)
    assert (rec.outputs(0, 1) == 0).all() and (rec.outputs(0, 0) != 0).any()
    torch.testing.assert_close(restored, plain, atol=0, rtol=0)


def test_a_model_not_on_our_kernel_is_refused_with_the_fix():
    model = build("bert").eval()  # transformers' default implementation
    with pytest.raises(ValueError, match=r'model: expected a transformers model running attn_implementation="mu'):
        capture(model)
    _, ours = pair(build("gpt2"))
    with pytest.raises(ValueError, match=r"part: expected one of the model's parts \['self'\], got 'cross'"):
        capture(ours, part="cross")
    with pytest.raises(ValueError, match=r"layers: expected layer indices in 0\.\.1 \(or -2\.\.-1, .*\), got 2"):
        capture(ours, layers=[2])


def test_a_model_whose_stack_runs_another_implementation_is_refused_naming_the_module():
    """T5's stacks keep copies of the config; transformers before 5.20 switched only the model's own."""
    from test_integrations_transformers import build_t5

    _, ours = pair(build_t5())
    attention = ours.decoder.block[1].layer[0].SelfAttention
    attention.config = copy.deepcopy(attention.config)
    attention.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"decoder\.block\.1\.layer\.0\.SelfAttention \(T5Attention\) runs 'sdpa'"):
        capture(ours, part="decoder")


def test_t5_with_its_position_bias_is_recorded_as_transformers_computes_it():
    from test_integrations_transformers import build_t5

    theirs, ours = pair(build_t5())
    batch = inputs(padded=False)
    target = torch.randint(3, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(**batch, decoder_input_ids=target, output_attentions=True)
    assert [(s.part, s.index) for s in attention_sites(ours)][-2:] == [("cross", 0), ("cross", 1)]
    with torch.no_grad(), capture(ours, part="decoder") as decoder, capture(ours, part="cross") as cross:
        ours(**batch, decoder_input_ids=target)
    for layer in (0, 1):  # the bias (and, in the decoder, the causal mask) shape every recorded weight
        torch.testing.assert_close(decoder.weights(layer), expected.decoder_attentions[layer], atol=1e-12, rtol=0)
        torch.testing.assert_close(cross.weights(layer), expected.cross_attentions[layer], atol=1e-12, rtol=0)

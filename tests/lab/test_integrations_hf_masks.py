"""transformers' masks reach the kernel as typed masks (multihead.integrations.transformers_masks).

The mask function registered for "multihead" must give, for every pattern it recognises, exactly the mask
transformers' own ``sdpa_mask`` builds (bound and made dense here), over a grid of batch sizes, query and key
lengths, cache-like offsets and padding; and hand everything else to ``sdpa_mask`` unchanged. On tiny random
models (built in memory, nothing downloaded) the outputs match transformers' own attention while the kernel
receives typed masks, never a (b, 1, i, j) tensor.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable

import pytest
import torch
import transformers
from transformers import masking_utils as hf

import multihead.attend
import multihead.functional
from multihead.integrations import transformers as integration
from multihead.integrations.transformers_masks import TransformersMask, kernel_mask, typed_mask
from multihead.integrations.transformers_versions import TRANSFORMERS_TESTED
from multihead.masks import AttentionShape, Mask, bind_mask, causal, padding
from test_integrations_transformers import BATCH, LENGTH, VOCAB, build_bart
from test_integrations_transformers import build as build_one_stack

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # in-memory configs only, never the hub

# --------------------------------------------------------------------------- the mask function, pattern by pattern

# The names the integration itself imports from transformers.masking_utils (and_masks, causal_mask_function,
# bidirectional_mask_function, sliding_window_overlay, sliding_window_bidirectional_overlay, sdpa_mask) are
# used as hf.<name>: importing the integration above has checked them (a transformers without one stops here
# with the integration's one-line error). Every other mask function a test builds comes from internal(), or from
# a model's own call (packed sequences).


def internal(name: str) -> Callable:
    """transformers.masking_utils.<name>, a helper no public API exposes. Every transformers in the tested range
    has it; one without it fails the case that needs it at run time (never the whole file at collection), naming
    the version and the helper, so a drift is seen rather than skipped."""
    function = getattr(hf, name, None)
    if not callable(function):
        pytest.fail(
            f"transformers {transformers.__version__} has no masking_utils.{name} (tested on "
            f"{' to '.join(TRANSFORMERS_TESTED)}): see which mask this helper built and whether the integration "
            "still reads it"
        )
    return function


CAUSAL = {"allow_is_causal_skip": True}
BIDIRECTIONAL = {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": True}  # create_bidirectional_mask's

# name -> (mask function (built when the test runs), the flags transformers' create_* function passes, whether it
# has a diagonal)
PATTERNS: dict[str, tuple[Callable[[], Callable], dict, bool]] = {
    "causal": (lambda: hf.causal_mask_function, CAUSAL, True),
    "sliding 1": (lambda: internal("sliding_window_causal_mask_function")(1), {**CAUSAL, "local_size": 1}, True),
    "sliding 3": (lambda: internal("sliding_window_causal_mask_function")(3), {**CAUSAL, "local_size": 3}, True),
    "sliding 6": (lambda: internal("sliding_window_causal_mask_function")(6), {**CAUSAL, "local_size": 6}, True),
    # the same pieces, nested and in another order
    "sliding 4 nested": (
        lambda: hf.and_masks(hf.causal_mask_function, hf.and_masks(hf.sliding_window_overlay(4))),
        {**CAUSAL, "local_size": 4},
        True,
    ),
    "bidirectional": (lambda: hf.bidirectional_mask_function, BIDIRECTIONAL, False),
    "bidirectional sliding 0": (
        lambda: internal("sliding_window_bidirectional_mask_function")(0),
        BIDIRECTIONAL,
        True,
    ),
    "bidirectional sliding 2": (
        lambda: internal("sliding_window_bidirectional_mask_function")(2),
        BIDIRECTIONAL,
        True,
    ),
}

# (q_length i, kv_length j, q_offset, kv_offset): single queries, i > j, and the offsets caches give
SIZES = list(itertools.product((1, 2, 5), (1, 3, 7, 8), (0, 2, 6), (0, 1, 4)))
PADDINGS = ("none", "all real", "right", "left", "random", "a row fully padded")


def padding_mask(kind: str, batch: int, columns: int, seed: int) -> torch.Tensor | None:
    """A (b, n) bool padding mask, True = real token."""
    if kind == "none":
        return None
    positions = torch.arange(columns)
    lengths = torch.tensor([max(columns - 2 * row, 0) for row in range(batch)])[:, None]  # rows of distinct lengths
    if kind == "all real":
        return torch.ones(batch, columns, dtype=torch.bool)
    if kind == "right":
        return positions < lengths
    if kind == "left":
        return positions >= columns - lengths
    valid = torch.rand(batch, columns, generator=torch.Generator().manual_seed(seed)) < 0.6
    if kind == "a row fully padded":
        valid[0] = False
    return valid


def cases():
    """Every size with every padding kind; batch 1-3 and the padding mask's length cycle along."""
    for number, ((i, j, q_offset, kv_offset), kind) in enumerate(itertools.product(SIZES, PADDINGS)):
        batch = 1 + number % 3
        # as long as the positions seen (kv_offset + j), shorter (sdpa_mask pads it with False) or longer
        columns = max(1, kv_offset + j + (0, -1, 2)[number % 3])
        yield batch, i, j, q_offset, kv_offset, padding_mask(kind, batch, columns, seed=number)


def dense(mask: Mask | torch.Tensor | None, batch: int, i: int, j: int) -> torch.Tensor:
    """The (b, 1, i, j) bool tensor a mask means (None: full attention)."""
    if isinstance(mask, torch.Tensor):
        return mask.expand(batch, 1, i, j)
    bound = bind_mask(mask, False, AttentionShape(batch, 1, i, j, torch.device("cpu")))
    keep, bias = bound.dense(torch.float32)
    assert bias is None
    return torch.ones(batch, 1, i, j, dtype=torch.bool) if keep is None else keep.expand(batch, 1, i, j)


def literal(**arguments) -> torch.Tensor:
    """sdpa_mask's mask with no skip: every pair evaluated (what transformers' eager attention is given)."""
    arguments = {**arguments, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}
    return hf.sdpa_mask(**arguments).expand(arguments["batch_size"], 1, arguments["q_length"], arguments["kv_length"])


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_recognised_patterns_give_sdpa_masks_mask_as_a_typed_mask(pattern):
    make, flags, diagonal = PATTERNS[pattern]
    function = make()
    typed = 0
    for batch, i, j, q_offset, kv_offset, valid in cases():
        arguments = {
            "batch_size": batch,
            "q_length": i,
            "kv_length": j,
            "q_offset": q_offset,
            "kv_offset": kv_offset,
            "mask_function": function,
            "attention_mask": valid,
            **flags,
        }
        theirs = hf.sdpa_mask(**arguments)
        ours = typed_mask(**arguments)
        where = f"{pattern}: b={batch} i={i} j={j} q_offset={q_offset} kv_offset={kv_offset} padding={valid}"
        # typed exactly when the diagonal's offset is one of ours: j - i (bottom-right) or 0 (top-left)
        if diagonal and q_offset - kv_offset not in (j - i, 0):
            assert ours is None if theirs is None else torch.equal(ours, theirs), where  # sdpa_mask's own answer
            continue
        if ours is None:  # only full attention without padding, where transformers leaves the mask out as well
            assert pattern == "bidirectional" and theirs is None, where
            continue
        assert isinstance(ours, TransformersMask), where
        typed += 1
        # where sdpa_mask leaves the mask out (for SDPA's is_causal), the pairs that stands for: its literal mask
        expected = literal(**arguments) if theirs is None else theirs.expand(batch, 1, i, j)
        assert torch.equal(dense(ours, batch, i, j), expected), where
        assert torch.equal(ours.dense(), expected), where
        kinds = bind_mask(ours, False, AttentionShape(batch, 1, i, j, torch.device("cpu"))).kinds()
        assert set(kinds) <= {"diagonal", "padding"}, where
    assert typed > len(SIZES)  # most of the grid went typed


def test_a_cache_step_is_bottom_right_and_a_static_prefill_top_left():
    # a dynamic cache: 4 tokens seen, 2 new -> keys 0 ... 5, queries at 4, 5
    step = typed_mask(1, 2, 6, q_offset=4, kv_offset=0)
    assert isinstance(step, TransformersMask) and repr(step.parts[0]) == repr(causal("bottom_right"))
    # a static cache's prefill: 3 queries over its 8 slots, the unused ones after them
    prefill = typed_mask(1, 3, 8, q_offset=0, kv_offset=0)
    assert isinstance(prefill, TransformersMask) and repr(prefill.parts[0]) == repr(causal("top_left"))
    # a sliding-window cache that dropped 5 keys: keys 5 ... 9 for queries 8, 9
    sliding = internal("sliding_window_causal_mask_function")(3)
    window_step = typed_mask(1, 2, 5, q_offset=8, kv_offset=5, mask_function=sliding)
    assert "window(left=2, right=0, align='bottom_right')" in repr(window_step)


def test_full_attention_without_padding_is_none_only_where_the_caller_allows_it():
    assert typed_mask(2, 3, 3, mask_function=hf.bidirectional_mask_function, **BIDIRECTIONAL) is None
    all_real = torch.ones(2, 3, dtype=torch.bool)
    assert (
        typed_mask(2, 3, 3, mask_function=hf.bidirectional_mask_function, attention_mask=all_real, **BIDIRECTIONAL)
        is None
    )
    # a caller that allows only the causal skip gets an explicit mask with no term: full attention, never causal
    ours = typed_mask(2, 3, 3, mask_function=hf.bidirectional_mask_function, allow_is_causal_skip=True)
    assert isinstance(ours, TransformersMask) and ours.terms() == ()
    assert torch.equal(ours.dense(), torch.ones(2, 1, 3, 3, dtype=torch.bool))


def left_padding() -> torch.Tensor:
    return torch.tensor([[True] * 5, [False, False, True, True, True]])


# two sequences packed in each row (lengths 2 and 3): the position ids a packing collator gives
PACKED_POSITIONS = torch.tensor([[0, 1, 0, 1, 2]] * 2)


def packed_call(name: str = "llama", positions: torch.Tensor = PACKED_POSITIONS) -> dict:
    """The arguments a causal model hands the mask interface for packed sequences, taken from a call.

    transformers has no public builder for its mask function (its helpers were renamed and rewired between
    releases), so it is recorded where a model makes it: a tiny model on "multihead" given ``positions`` and no
    attention mask.
    """
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return typed_mask(*args, **kwargs)

    model = build_one_stack(name).eval()
    model.set_attn_implementation(integration.IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, positions.shape, generator=torch.Generator().manual_seed(3))
    transformers.AttentionMaskInterface.register(integration.IMPLEMENTATION, recording)
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions, use_cache=False)
    finally:
        transformers.AttentionMaskInterface.register(integration.IMPLEMENTATION, typed_mask)
    assert calls, "the model never asked the mask interface for a mask"
    assert calls[0]["mask_function"] is not hf.causal_mask_function, "transformers did not see packed sequences"
    return calls[0]


def packed_sequence_mask_function() -> tuple[Callable, bool]:
    """(mask function, use_vmap) of a packed call, passed on without the model's config."""
    call = packed_call()
    return call["mask_function"], bool(call.get("use_vmap", False))


# name -> (mask function, use_vmap), built when the test runs; use_vmap as transformers' create_* functions set it
# (True for user-given functions)
UNRECOGNISED: dict[str, Callable[[], tuple[Callable, bool]]] = {
    "or_masks": lambda: (internal("or_masks")(hf.causal_mask_function, hf.sliding_window_overlay(2)), True),
    "chunked": lambda: (internal("chunked_causal_mask_function")(2, torch.zeros(2, dtype=torch.long)), False),
    "a lambda": lambda: (lambda b, h, q, kv: kv <= q, True),
    "and_masks with a lambda": lambda: (hf.and_masks(hf.causal_mask_function, lambda b, h, q, kv: kv != 1), True),
    "packed sequences without a config": packed_sequence_mask_function,
    "blockwise": lambda: (
        internal("or_masks")(
            hf.causal_mask_function, internal("blockwise_overlay")(torch.tensor([[0, 0, -1, 1, 1]] * 2))
        ),
        False,
    ),
    "an empty window": lambda: (internal("sliding_window_causal_mask_function")(0), False),
}


@pytest.mark.parametrize("name", list(UNRECOGNISED))
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_what_is_not_recognised_is_sdpa_masks_dense_tensor(name, padded):
    function, use_vmap = UNRECOGNISED[name]()
    arguments = {
        "batch_size": 2,
        "q_length": 5,
        "kv_length": 5,
        "mask_function": function,
        "attention_mask": left_padding() if padded else None,
        "use_vmap": use_vmap,
    }
    for skip in (False, True):  # the skip allowed or not, as transformers' own callers may pass it
        arguments["allow_is_causal_skip"] = skip
        ours, theirs = typed_mask(**arguments), hf.sdpa_mask(**arguments)
        assert ours is None if theirs is None else isinstance(ours, torch.Tensor) and torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "change",
    [
        {"allow_is_causal_skip": False},  # a caller that goes on to edit the tensor (Falcon adds ALiBi to it)
        {"q_offset": torch.tensor(2)},  # a static cache's offset: reading it would break a compiled graph
        {"attention_mask": left_padding().long()},  # not the bool mask transformers prepares
        {"attention_mask": left_padding()[:1]},  # not one row per batch element
        {"kv_offset": 1},  # an offset relation no typed diagonal has (d = 1, j - i = 0)
    ],
    ids=["no skip allowed", "tensor offset", "integer padding", "one padding row", "other offsets"],
)
def test_what_cannot_be_said_with_certainty_falls_back(change):
    arguments = {"batch_size": 2, "q_length": 3, "kv_length": 5, "q_offset": 2, "attention_mask": left_padding()}
    arguments.update(change)
    try:
        theirs = hf.sdpa_mask(**arguments)
    except (IndexError, RuntimeError) as error:  # what transformers refuses, it refuses the same way
        with pytest.raises(type(error)):
            typed_mask(**arguments)
        return
    ours = typed_mask(**arguments)
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["llama", "mistral"])  # causal, and Mistral's sliding window (3)
@pytest.mark.parametrize("padded", [False, True], ids=["alone", "padded"])
def test_packed_sequences_are_documents_and_the_band(name, padded):
    call = packed_call(name, torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]] * 2))
    if padded:
        call["attention_mask"] = torch.tensor([[True] * 10, [False] * 2 + [True] * 8])
    ours, theirs = typed_mask(**call), hf.sdpa_mask(**call)
    assert isinstance(ours, TransformersMask)
    kinds = set(bind_mask(ours, False, AttentionShape(2, 1, 10, 10, torch.device("cpu"))).kinds())
    assert kinds == {"documents", "diagonal"} | ({"padding"} if padded else set())
    assert torch.equal(ours.dense(), theirs.expand(2, 1, 10, 10))


@pytest.mark.parametrize(
    "change",
    [
        {"config": None},  # who asks is unknown: a model that edits the tensor looks the same
        {"model_type": "falcon"},  # asks for a tensor to add ALiBi to it
        {"ids": torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]] * 2)},  # documents that do not follow the positions
    ],
    ids=["no config", "falcon", "other documents"],
)
def test_packed_calls_that_cannot_be_said_with_certainty_stay_dense(change):
    call = packed_call("llama", torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]] * 2))
    if "config" in change:
        del call["config"]
    if "model_type" in change:
        call["config"] = copy.copy(call["config"])
        call["config"].model_type = change["model_type"]
    if "ids" in change:  # the same closures, over other documents
        parts = [
            internal("packed_sequence_mask_function")(change["ids"])
            if part.__qualname__.startswith("packed_sequence_mask_function")
            else part
            for part in integration_parts(call["mask_function"])
        ]
        call["mask_function"] = hf.and_masks(*parts)
    ours = typed_mask(**call)
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, hf.sdpa_mask(**call))


def integration_parts(function: Callable) -> tuple:
    """The functions an and_masks closure combines."""
    cells = dict(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__), strict=True))
    return cells["mask_functions"]


def test_kernel_mask_keeps_the_first_keys():
    assert kernel_mask(None, 4) is None
    tensor = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    assert kernel_mask(tensor, 4).shape == (2, 1, 3, 4)
    theirs = padding(torch.tensor([3, 4])) & causal()
    assert kernel_mask(theirs, 4) is theirs  # a typed mask of another origin is bound to the call's own sizes
    ours = typed_mask(2, 3, 6, q_offset=3, attention_mask=left_padding())
    assert isinstance(ours, TransformersMask)
    assert kernel_mask(ours, 6) is ours
    # fewer keys than it was built for: its first columns, not the diagonal moved to the new last key
    shorter = kernel_mask(ours, 4)
    expected = literal(batch_size=2, q_length=3, kv_length=6, q_offset=3, attention_mask=left_padding())
    assert isinstance(shorter, torch.Tensor) and torch.equal(shorter, expected[..., :4])


def test_kernel_mask_refuses_what_is_no_mask():
    with pytest.raises(TypeError, match=r"attention_mask: expected None, a multihead.masks mask.*got list"):
        kernel_mask([[True]], 1)


# --------------------------------------------------------------------------- end to end on tiny random models


def build(name: str) -> torch.nn.Module:
    """The tiny random models of test_integrations_transformers.py; Mistral's window (3) is shorter than LENGTH."""
    return build_bart() if name == "bart" else build_one_stack(name)


# architecture -> the implementation that is exact in float64 (Llama's and Mistral's eager softmax is float32)
ORACLE = {"bert": "eager", "gpt2": "eager", "llama": "sdpa", "mistral": "sdpa", "bart": "eager"}


def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    theirs = build(name).to(torch.float64).eval()
    theirs.set_attn_implementation(ORACLE[name])
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def batch(padding_side: str | None) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    if padding_side == "right":
        mask[1, 6:] = 0
    if padding_side == "left":
        mask[1, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def kernel_masks(monkeypatch) -> list[tuple[type, list[str]]]:
    """(type of the mask, kinds of its bound terms) of every kernel call the integration makes from now on."""
    calls = []
    original = multihead.functional.attention_result

    def recording(q, k, v, *, mask=None, causal=False, **options):
        shape = AttentionShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        calls.append((type(mask), bind_mask(mask, causal, shape).kinds()))
        return original(q, k, v, mask=mask, causal=causal, **options)

    # where the kernel is called: the attention step every call of the integration goes through
    monkeypatch.setattr(multihead.attend, "attention_result", recording)
    return calls


def assert_typed(calls: list[tuple[type, list[str]]], kinds: set[str]) -> None:
    assert calls, "the kernel never ran"
    for mask_type, call_kinds in calls:
        assert mask_type is type(None) or issubclass(mask_type, Mask), mask_type  # never a tensor
        assert set(call_kinds) <= {"diagonal", "padding"}
    assert set().union(*(set(k) for _, k in calls)) == kinds


def output(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize(
    "name, padding_side, kinds",
    [
        ("bert", "right", {"padding"}),
        ("gpt2", None, {"diagonal"}),
        ("gpt2", "right", {"diagonal", "padding"}),
        ("llama", "left", {"diagonal", "padding"}),
        ("mistral", None, {"diagonal"}),
        ("mistral", "left", {"diagonal", "padding"}),
    ],
)
def test_models_match_transformers_while_the_kernel_gets_typed_masks(name, padding_side, kinds, monkeypatch):
    theirs, ours = pair(name)
    inputs = batch(padding_side)
    calls = kernel_masks(monkeypatch)
    with torch.no_grad():
        expected, got = output(theirs, inputs), output(ours, inputs)
    assert_typed(calls, kinds)
    assert all(mask_type is TransformersMask for mask_type, _ in calls)
    real = inputs["attention_mask"].bool()  # padding positions' rows are arbitrary
    torch.testing.assert_close(got[real], expected[real], atol=1e-10, rtol=1e-10)


def test_packed_sequences_match_transformers_with_a_documents_mask(monkeypatch):
    """Packed sequences (position ids that restart, no attention mask) reach the kernel as documents & causal, not
    a tensor: each sequence sees only itself, and the logits equal transformers' own."""
    theirs, ours = pair("llama")
    packed = {
        "input_ids": torch.randint(3, VOCAB, PACKED_POSITIONS.shape, generator=torch.Generator().manual_seed(4)),
        "position_ids": PACKED_POSITIONS,
        "use_cache": False,
    }
    calls = kernel_masks(monkeypatch)
    with torch.no_grad():
        expected, got = output(theirs, packed), output(ours, packed)
        assert calls and all(mask_type is TransformersMask for mask_type, _ in calls)
        assert all(set(kinds) == {"documents", "diagonal"} for _, kinds in calls)
        unpacked = output(ours, {"input_ids": packed["input_ids"], "use_cache": False})
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    # the second sequence's first token sees only itself: not what one causal sequence of 5 gives
    assert not torch.allclose(got[:, 2], unpacked[:, 2])
    torch.testing.assert_close(got[:, :2], unpacked[:, :2], atol=1e-10, rtol=1e-10)


def test_mistrals_window_is_typed_and_shorter_than_the_sequence(monkeypatch):
    _, ours = pair("mistral")
    seen = []
    original = multihead.functional.attention_result

    def recording(q, k, v, *, mask=None, **options):
        seen.append(repr(mask))
        return original(q, k, v, mask=mask, **options)

    monkeypatch.setattr(multihead.attend, "attention_result", recording)  # where every step calls the kernel
    with torch.no_grad():
        ours(**batch(None))
    assert seen and all("window(left=2, right=0" in text for text in seen)


def test_bart_encoder_decoder_and_cross_attention_with_padding(monkeypatch):
    theirs, ours = pair("bart")
    inputs = batch("right")  # padded source: the cross-attention's keys are masked on the second row
    target = torch.randint(3, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(2))
    calls = kernel_masks(monkeypatch)
    with torch.no_grad():
        expected = theirs(**inputs, decoder_input_ids=target).logits
        got = ours(**inputs, decoder_input_ids=target).logits
    # encoder and cross-attention: padding; decoder self-attention: causal
    assert_typed(calls, {"diagonal", "padding"})
    assert sorted(kinds for _, kinds in calls) == [["diagonal"]] * 2 + [["padding"]] * 4
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generate_with_the_models_cache_and_left_padding(name, monkeypatch):
    theirs, ours = pair(name)
    prompt = batch("left")  # the second prompt starts after 4 padding tokens
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    expected = theirs.generate(**prompt, **settings)
    calls = kernel_masks(monkeypatch)
    got = ours.generate(**prompt, **settings)
    assert torch.equal(got, expected)
    assert got.shape == (BATCH, LENGTH + 8)
    assert_typed(calls, {"diagonal", "padding"})
    assert len(calls) == 2 * 8  # two layers, a prefill and 7 decoding steps

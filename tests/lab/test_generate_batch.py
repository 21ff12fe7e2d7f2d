"""Decoder.generate_batch: prompts of different lengths decoded together through a paged cache, each stopping at
its own EOS or length, new ones admitted as others finish (continuous batching); greedy and seeded sampling give
the tokens generating each prompt alone gives."""

from __future__ import annotations

import pytest
import torch

from multihead.lab.models.decoder import Decoder, DecoderConfig, PagedDecoderCache
from support import is_input_error

pytestmark = pytest.mark.portable

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 3, 3], [9, 9, 9, 9, 9, 9, 9]]
BUDGETS = [6, 3, 8, 5, 2, 4]


def model(positions: str, device, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    config = DecoderConfig(
        vocab_size=20, max_positions=24, hidden=32, layers=2, heads=4, kv_heads=2, mlp=64, positions=positions
    )
    return Decoder(config).to(device=device, dtype=torch.float64)


def alone(decoder: Decoder, prompt, budget, eos_id=None, **sampling) -> list[int]:
    """generate() on the prompt by itself, cut after its first EOS among the new tokens."""
    tokens = decoder.generate(prompt, budget, **sampling)[0].tolist()
    new = tokens[len(prompt) :]
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id) + 1]
    return prompt + new


@pytest.mark.parametrize("max_batch", [1, 2, 16])
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_greedy_batches_give_each_prompts_own_tokens(positions, max_batch, device):
    decoder = model(positions, device)
    out = decoder.generate_batch(PROMPTS, BUDGETS, max_batch=max_batch, page_size=3)
    assert [o.tolist() for o in out] == [alone(decoder, p, n) for p, n in zip(PROMPTS, BUDGETS, strict=True)]


def test_seeded_sampling_gives_each_prompts_own_tokens(device):
    decoder = model("rotary", device, seed=1)
    seeds = [11, 12, 13, 14, 15, 16]
    out = decoder.generate_batch(PROMPTS, 6, temperature=0.9, top_k=8, seeds=seeds, max_batch=3, page_size=2)
    expected = [alone(decoder, p, 6, temperature=0.9, top_k=8, seed=s) for p, s in zip(PROMPTS, seeds, strict=True)]
    assert [o.tolist() for o in out] == expected


def test_each_sequence_stops_at_its_own_eos(device):
    decoder = model("rotary", device)
    free_run = [alone(decoder, p, 8) for p in PROMPTS]
    eos = free_run[2][len(PROMPTS[2]) + 1]  # the second token prompt 2 writes: an EOS for it, maybe for others
    out = decoder.generate_batch(PROMPTS, 8, eos_id=eos, max_batch=4)
    assert [o.tolist() for o in out] == [alone(decoder, p, 8, eos_id=eos) for p in PROMPTS]
    new = out[2][len(PROMPTS[2]) :].tolist()
    assert len(new) <= 2 and new[-1] == eos and eos not in new[:-1]  # stopped at its first EOS, kept


def test_finished_sequences_make_room_for_waiting_ones(monkeypatch, device):
    # max_batch 2 over 6 prompts: every decode step runs at most 2 sequences, a new one joins as one ends, and
    # every page is back in the pool at the end
    decoder = model("rotary", device)
    caches: list[PagedDecoderCache] = []
    sizes: list[int] = []
    build = Decoder.new_paged_cache

    def recording_cache(self, *args, **kwargs):
        caches.append(build(self, *args, **kwargs))
        original = caches[-1].batch

        def batch(handles):
            sizes.append(len(handles))
            return original(handles)

        caches[-1].batch = batch
        return caches[-1]

    monkeypatch.setattr(Decoder, "new_paged_cache", recording_cache)
    out = decoder.generate_batch(PROMPTS, BUDGETS, max_batch=2, page_size=3)
    assert [o.tolist() for o in out] == [alone(decoder, p, n) for p, n in zip(PROMPTS, BUDGETS, strict=True)]
    assert max(sizes) == 2 and sizes.count(2) > len(PROMPTS)  # decode steps of two, the prefills of one
    assert caches[0].pages_in_use == 0


def test_a_prompt_with_nothing_to_add_comes_back_as_it_is(device):
    decoder = model("rotary", device)
    out = decoder.generate_batch([[3, 4], [5]], [0, 2])
    assert out[0].tolist() == [3, 4] and out[1].tolist() == alone(decoder, [5], 2)


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({"prompts": []}, ValueError, "prompts: expected a non-empty list"),
        ({"max_new_tokens": [1, 2]}, ValueError, "max_new_tokens: expected one int, or 6"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens: expected an int >= 0"),
        ({"seeds": [1, 2]}, ValueError, "seeds: expected 6 seeds"),
        ({"eos_id": 20}, ValueError, "eos_id: expected a token id in [0, 20)"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"prompts": [[1, 25]]}, ValueError, "prompt_ids"),
    ],
)
def test_bad_arguments_are_named(arguments, kind, fragment):
    decoder = model("rotary", "cpu")
    call = {"prompts": PROMPTS, "max_new_tokens": 3} | arguments
    with pytest.raises(kind) as raised:
        decoder.generate_batch(call.pop("prompts"), call.pop("max_new_tokens"), **call)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_learned_positions_refuse_sequences_past_the_table():
    decoder = model("learned", "cpu")
    with pytest.raises(ValueError) as raised:
        decoder.generate_batch([[1] * 20], 5)
    assert "max_new_tokens: expected prompt + new tokens <= max_positions = 24" in str(raised.value)

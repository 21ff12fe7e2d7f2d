"""multihead._memory: large fresh tensors advised onto transparent huge pages, and nothing else changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from multihead import _memory, attention_result
from support import make_qkv


@pytest.fixture
def thp_mode(monkeypatch, tmp_path):
    """Pretend the kernel's THP mode is the given one (the cached libc lookup is reset around the test)."""

    def use(mode: str) -> None:
        mode_file = tmp_path / "enabled"
        mode_file.write_text(mode + "\n")
        monkeypatch.setattr(_memory, "THP_MODE_FILE", mode_file)
        _memory._madvise.cache_clear()

    yield use
    _memory._madvise.cache_clear()


def _mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields ({"VmFlags": "rd wr mr ... hg", "THPeligible": "1", ...}) of the mapping
    holding ``address`` (empty when not found)."""
    inside, found = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split(maxsplit=1)
        if "-" in fields[0] and ":" not in fields[0]:
            if inside:
                break
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < stop
        elif inside and fields[0].endswith(":"):
            found[fields[0][:-1]] = fields[1].strip() if len(fields) > 1 else ""
    return found


def test_small_tensors_are_left_alone():
    t = torch.empty(1024, 1024)  # 4 MiB: may share glibc's heap with other allocations
    assert not _memory.advise_huge_pages(t)


@pytest.mark.parametrize("mode", ["[always] madvise never", "always madvise [never]"])
def test_no_advice_where_it_would_change_nothing(thp_mode, mode):
    thp_mode(mode)
    assert not _memory.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8))


def test_large_fresh_tensor_lands_on_huge_pages_where_the_kernel_offers_them():
    t = _memory.empty_written_once(16, 1024, 1024, dtype=torch.float32, device=torch.device("cpu"))  # 64 MiB
    advised = _memory._madvise() is not None
    if not advised:  # another OS or THP mode: the plain tensor, nothing asked
        assert not _memory.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8))
        return
    t.fill_(1.0)
    # what we ask is the mapping's MADV_HUGEPAGE flag ("hg"), which makes it eligible; whether the kernel then
    # finds free huge pages (its AnonHugePages) depends on the machine's memory at that moment, not on us
    fields = _mapping_fields(t.data_ptr() + (8 << 20))
    assert "hg" in fields.get("VmFlags", "").split(), fields
    assert fields.get("THPeligible") == "1", fields


def test_materialized_weights_are_the_same_with_and_without_huge_pages(monkeypatch):
    q, k, v = make_qkv(b=1, h=4, g=4, i=2100, j=1100, d=8, e=8, dtype=torch.float32)  # 37 MB of weights
    advised = attention_result(q, k, v, causal=True, backend="materialized", return_weights=True)
    monkeypatch.setattr(_memory, "MIN_ADVISED_BYTES", 1 << 62)
    plain = attention_result(q, k, v, causal=True, backend="materialized", return_weights=True)
    assert torch.equal(advised.output, plain.output) and torch.equal(advised.weights, plain.weights)
    # rows 0-999 attend no key under bottom-right causal (j < i): the live key spans at the real block sizes
    oracle = attention_result(*(t.double() for t in (q, k, v)), causal=True, backend="reference", return_weights=True)
    torch.testing.assert_close(advised.weights.double(), oracle.weights, atol=1e-5, rtol=0)
    torch.testing.assert_close(advised.output.double(), oracle.output, atol=1e-5, rtol=0)

"""multihead's native CPU kernel (backends/native): its causal forward against the float64 reference at block sizes
that cut every path of its loop (key chunks, the diagonal square, a last short block, grouped heads, d != e, more keys
than queries, strided inputs, a negative scale); the spans backend's results with it and with torch's kernel in its
place; what explain says of it; and how it is built, found and turned off (the reason given, never a failed call)."""

from __future__ import annotations

import shutil

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import native, spans
from support import is_input_error, make_qkv

# This machine kind has a C++ compiler and ninja: the kernel must build here. A machine without them runs torch's
# kernel, and the tests below that need the native kernel say why it is missing instead of passing without it.
CAN_BUILD = shutil.which("c++") is not None and shutil.which("ninja") is not None


def require_native():
    assert native.available(), f"the native kernel {native.unavailable_reason()} (compiler and ninja: {CAN_BUILD})"


def reference_causal(q, k, v, scale):
    """Row t sees keys 0..t: output and LSE in float64."""
    n, m = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    keep = torch.ones(n, m, dtype=torch.bool).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v64, torch.logsumexp(scores, -1)


# (b, h, g, n, m, d, e, block rows, block keys)
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8, 128, 512),  # one row
    (2, 4, 2, 300, 300, 16, 8, 4, 8),  # many chunks of 8 keys before 4-row diagonal squares
    (1, 6, 3, 129, 200, 32, 48, 16, 64),  # more keys than queries (never read past row n), a last short block
    (1, 2, 1, 700, 700, 64, 64, 128, 512),  # the kernel's own block sizes: chunks of 512 keys, then squares of 128
    (1, 3, 3, 37, 37, 5, 3, 7, 3),  # key chunks narrower than a block (the square still read whole), odd widths
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", [0.125, -0.8])
def test_the_causal_forward_equals_the_float64_reference(shape, scale):
    require_native()
    b, h, g, n, m, d, e, block_rows, block_keys = shape
    gen = torch.Generator().manual_seed(n)
    q, k = torch.randn(b, h, n, d, generator=gen), torch.randn(b, g, m, d, generator=gen)
    v = torch.randn(b, g, m, e, generator=gen)
    out, lse = torch.ops.multihead_native.causal_forward(q, k, v, scale, block_rows, block_keys)
    want_out, want_lse = reference_causal(q, k, v, scale)
    assert out.shape == (b, h, n, e) and lse.shape == (b, h, n) and out.dtype == lse.dtype == torch.float32
    # float32 sums, and an exp exact to 20 ulp
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_any_thread_count_give_the_same_result():
    """Queries read in place from a (b, n, h, d) layout, and keys whose last dimension is strided (copied dense by
    the wrapper); the blocks run in any order on any number of threads and give identical results."""
    require_native()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 450, 4, 32, generator=gen).transpose(1, 2)  # (b, h, n, d), rows 4 * 32 apart
    k = torch.randn(2, 2, 32, 450, generator=gen).transpose(-1, -2)  # last dimension strided
    v = torch.randn(2, 2, 450, 16, generator=gen)
    out, lse = native.causal_forward(q, k, v, 0.2)
    want_out, want_lse = reference_causal(q, k, v, 0.2)
    # float32 sums, and an exp exact to 20 ulp
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native.causal_forward(q, k, v, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], out) and torch.equal(alone[1], lse)


def test_it_agrees_with_torchs_causal_kernel_which_its_callers_fall_back_to():
    require_native()
    q, k, v = (t.float() for t in make_qkv(b=1, h=8, g=2, i=600, j=600, d=64, e=64, seed=1))
    out, lse = native.causal_forward(q, k, v, 0.125)
    torch_out, torch_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=True, scale=0.125
    )
    torch.testing.assert_close(out, torch_out, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse, torch_lse, rtol=0, atol=2e-6)


def packed_documents(lengths):
    return masks.documents(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None])


@pytest.mark.parametrize("use", [True, False], ids=["native", "torch's kernel"])
def test_spans_gives_the_references_output_lse_and_gradients_on_either_kernel(use):
    """Packed documents under causal (each a causal triangle) and a causal call after a prefix every row sees, in
    float32, with the triangles on the native kernel and on torch's: the same results, forward and backward."""
    if use:
        require_native()
    for b, i, j, mask in (
        (1, 700, 700, packed_documents([300, 37, 363]) & masks.causal()),
        (1, 300, 800, masks.causal()),
    ):
        q, k, v = make_qkv(b=b, h=4, g=2, i=i, j=j, d=16, e=8, seed=7)
        results = {}
        for backend, dtype in (("reference", torch.float64), ("spans", torch.float32)):
            leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
            with native.use_native(use):
                result = multihead.attention_result(*leaves, mask=mask, backend=backend, return_lse=True)
                loss = (result.output * torch.linspace(-1, 1, result.output.numel()).view_as(result.output)).sum()
                grads = torch.autograd.grad(loss + result.lse.sum(), leaves)
            results[backend] = (result.output, result.lse, *grads)
        names = ("out", "lse", "dq", "dk", "dv")
        for name, got, want in zip(names, results["spans"], results["reference"], strict=True):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5, msg=f"{name}, native={use}")


def test_explain_names_the_kernel_of_the_causal_triangles():
    require_native()
    q, k, v = (t.float() for t in make_qkv(b=1, h=4, g=2, i=600, j=600, d=16, e=16))
    mask = packed_documents([300, 300]) & masks.causal()
    on_native = str(multihead.explain(q, k, v, mask=mask).estimates["spans"])
    assert "causal triangles on multihead's native kernel (128-row blocks)" in on_native
    with native.use_native(False):
        on_torch = str(multihead.explain(q, k, v, mask=mask).estimates["spans"])
    assert "causal triangles on torch's flash kernel (the native kernel is turned off by use_native(False))" in on_torch
    assert "the native kernel computes float32, not torch.float64" in spans._causal_note(torch.float64)
    # the estimate counts the blocks across the diagonal of the kernel that runs them
    assert spans.causal_diagonal_block(torch.float32) == native.CAUSAL_BLOCK_ROWS
    assert spans.causal_diagonal_block(torch.float64) == spans.CAUSAL_KEY_BLOCK


@pytest.fixture
def fresh_status(monkeypatch):
    """The loader as in a new process (nothing loaded yet); the process's real status comes back afterwards."""
    monkeypatch.setattr(native, "_loaded", None)
    return monkeypatch


def test_the_environment_turns_it_off_and_an_unknown_value_is_refused(fresh_status):
    fresh_status.setenv(native.ENABLE_ENV, "0")
    assert not native.available()
    assert native.unavailable_reason() == "is turned off by MULTIHEAD_NATIVE=0"
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    assert not native.serves_causal(q, k, v)  # so spans runs torch's kernel
    fresh_status.setattr(native, "_loaded", None)
    fresh_status.setenv(native.ENABLE_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"MULTIHEAD_NATIVE: expected 1/on .* or 0/off .*, got 'sometimes'") as raised:
        native.available()
    assert is_input_error(raised.value, ValueError)


def test_a_build_that_fails_gives_its_reason_and_spans_runs_torchs_kernel(fresh_status, tmp_path):
    blocked = tmp_path / "a file where the build folder would be"
    blocked.write_text("")
    fresh_status.setenv(native.DIR_ENV, str(blocked))
    assert not native.available()
    assert native.unavailable_reason().startswith("could not be built or loaded (")
    q, k, v = make_qkv(b=1, h=2, g=1, i=200, j=200, d=8, e=8, dtype=torch.float32)
    got = multihead.attention(q, k, v, causal=True, backend="spans")
    torch.testing.assert_close(got, multihead.attention(q, k, v, causal=True, backend="reference"), rtol=0, atol=2e-6)


def test_the_library_is_named_by_what_it_is_built_from(monkeypatch, tmp_path):
    """A changed source, flag or torch gives another library (built afresh, never a stale one loaded); the folder
    is MULTIHEAD_NATIVE_DIR where set, else multihead/native in the user's cache."""
    name = native.library_name()
    assert name.startswith("multihead_native_")
    monkeypatch.setattr(native, "compile_flags", lambda: ["-O2"])
    assert native.library_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native.library_name() != name
    monkeypatch.undo()
    monkeypatch.delenv(native.DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.build_folder() == tmp_path / "multihead" / "native"
    assert "-fopenmp" in native.compile_flags()  # its parallel_for runs on torch's OpenMP, not serially


def test_use_native_takes_a_bool():
    with pytest.raises(TypeError, match=r"enabled: expected a bool .*, got str 'no'") as raised:
        with native.use_native("no"):  # type: ignore[arg-type]
            pass
    assert is_input_error(raised.value, TypeError) and native.available()  # and nothing was turned off


def test_the_paged_decode_reads_the_pages_where_they_lie_and_stops_at_the_width():
    """Pages out of order and not every page of a sequence in use; slots past the width hold 1e6, so a key read
    past it shows. Against each sequence's keys gathered and attended densely, for d != e and widths that end
    inside a page."""
    require_native()
    gen = torch.Generator().manual_seed(0)
    pool_k = torch.full((9, 2, 4, 24), 1e6)
    pool_v = torch.full((9, 2, 4, 20), 1e6)
    tables = torch.tensor([[7, 2, 5, 0], [1, 8, 3, 6]])
    for width in (1, 10, 13, 16):
        for pages in tables.tolist():
            for slot in range(width):
                pool_k[pages[slot // 4], :, slot % 4] = torch.randn(2, 24, generator=gen)
                pool_v[pages[slot // 4], :, slot % 4] = torch.randn(2, 20, generator=gen)
        q = torch.randn(2, 2, 3, 24, generator=gen)  # (S, g, r, d)
        out = native.paged_forward(q, pool_k, pool_v, tables, width, 0.3)
        keys = pool_k[tables].transpose(1, 2).reshape(2, 2, 16, 24)[:, :, :width].double()
        values = pool_v[tables].transpose(1, 2).reshape(2, 2, 16, 20)[:, :, :width].double()
        want = torch.softmax(q.double() @ keys.transpose(-1, -2) * 0.3, -1) @ values
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=f"width {width}")
    with pytest.raises(RuntimeError, match="a page outside the pool"):
        native.paged_forward(q, pool_k, pool_v, torch.tensor([[9, 0, 0, 0], [0, 0, 0, 0]]), 5, 0.3)


def test_a_decode_step_of_one_length_runs_on_the_native_read_and_a_training_call_does_not(monkeypatch):
    """attention over a paged table whose sequences are all at one length (the table's rule: every key) goes to
    the native read in float32 with the same output as torch's path; with a gradient wanted it runs the path that
    autograd differentiates."""
    require_native()
    calls = []
    real = native.paged_forward
    monkeypatch.setattr(native, "paged_forward", lambda *args: calls.append(args) or real(*args))
    gen = torch.Generator().manual_seed(1)
    pool_k, pool_v = torch.randn(6, 2, 3, 8, generator=gen), torch.randn(6, 2, 3, 8, generator=gen)
    tables = torch.tensor([[4, 1], [0, 5]])
    ends, at = torch.tensor([5, 5]), torch.tensor([[4], [4]])
    pages = multihead.backends.PageTable(tables, torch.zeros(2, dtype=torch.long), ends, at, width=5)
    q = torch.randn(2, 4, 1, 8, generator=gen)
    out = multihead.attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert len(calls) == 1
    with native.use_native(False):
        on_torch = multihead.attention(q, pool_k, pool_v, pages=pages, causal=True)
    assert len(calls) == 1
    torch.testing.assert_close(out, on_torch, rtol=0, atol=1e-6)
    trained = multihead.attention(q.requires_grad_(True), pool_k, pool_v, pages=pages, causal=True)
    assert len(calls) == 1 and trained.grad_fn is not None
    torch.testing.assert_close(trained.detach(), out, rtol=0, atol=1e-6)


def test_a_fake_tensor_or_a_subclass_keeps_torchs_kernels():
    """While tracing (fake tensors) or on a tensor subclass other than a parameter, the native kernels are not
    called: they have no rule for them. Nor in another dtype."""
    require_native()
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain = torch.randn(1, 2, 8, 4)
    assert native.serves_causal(plain, plain, plain) and native.serves_paged(plain, plain, plain)
    with FakeTensorMode():
        fake = torch.randn(1, 2, 8, 4)
        assert not native.serves_causal(fake, fake, fake) and not native.serves_paged(fake, fake, fake)
    parameter = torch.nn.Parameter(torch.randn(1, 2, 8, 4))
    assert native.serves_causal(parameter, plain, plain)

    class Tagged(torch.Tensor):
        pass

    assert not native.serves_causal(plain.as_subclass(Tagged), plain, plain)
    assert not native.serves_causal(plain.double(), plain.double(), plain.double())

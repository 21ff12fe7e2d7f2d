"""What recording one head costs on a Hugging Face model: multihead's capture vs eager's output_attentions.

The random 6-layer Llama of benchmarks/hf.py (its ``llama()``: hidden 256, 8 query heads over 2 key/value
heads, RoPE), batch 1, float32, forward under torch.no_grad() at n = 512 and 2048, loaded three times with the
same weights. Six ways to run it, timed in one interleaved run (multihead.lab.bench.interleave: rounds of one block
each, the order rotating):

    (a) multihead                 attn_implementation="multihead", plain forward
    (b) multihead + capture 1     the same inside capture(model, layers=[L], heads=[H]): one head, every row
    (c) multihead + capture h     the same inside capture(model, layers=[L]): that layer's 8 heads
    (d) eager                     transformers' eager attention, plain forward
    (e) eager + attentions        eager with output_attentions=True: every layer's weights, the way tools
                                  such as bertviz or TransformerLens-style hooks get them today
    (f) sdpa                      transformers' SDPA attention, plain forward

Each capture call enters a fresh ``capture(...)`` around the forward, as a user would, and drops what it
recorded with it. Before timing, the script checks that the weights capture records equal eager's
output_attentions for that layer and head (and all heads) to 1e-5, that recording leaves the logits
bit-for-bit unchanged, and that all three implementations give the same logits. Each ratio is x / y per
round: median, lowest, highest. Peak memory is one call per way, measured by the harness
(harness.common.peak_memory: VmHWM above the RSS before the call, glibc's MALLOC_MMAP_THRESHOLD_=65536).

    python benchmarks/hf_capture.py [--quick]      # writes benchmarks/results/hf_capture.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from harness.common import ensure_malloc_env, peak_memory, prepare_allocator, ram_bytes, save_results
from hf import llama

import multihead
import multihead.integrations.transformers as integration
from multihead.lab.bench import interleave
from multihead.lab.inspect import capture
from multihead.machine import identity

REPO = Path(__file__).resolve().parent.parent
LAYER, HEAD = 3, 5  # the recorded layer (of 6) and head (of 8; it reads key/value head 1)
TOLERANCE = 1e-5  # recorded weights vs eager's output_attentions, float32

# key -> (letter, label)
WAYS = {
    "multihead": ("a", "multihead"),
    "capture_1": ("b", "multihead + capture 1 head"),
    "capture_h": ("c", "multihead + capture 8 heads"),
    "eager": ("d", "eager"),
    "eager_attentions": ("e", "eager + output_attentions"),
    "sdpa": ("f", "sdpa"),
}
RATIOS = (
    ("capture_1", "eager_attentions"),
    ("capture_h", "eager_attentions"),
    ("capture_1", "multihead"),
    ("capture_h", "multihead"),
    ("eager_attentions", "eager"),
    ("multihead", "sdpa"),
    ("multihead", "eager"),
)


class Call:
    """One forward as harness.common.peak_memory measures it (``step`` returns what the call keeps alive)."""

    def __init__(self, step: Callable[[], object]):
        self.step = step

    def clear(self) -> None:  # no gradients under no_grad
        pass


def ways(models: dict[str, torch.nn.Module], ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The six calls, each returning what it produced (the output, and the recorder for capture)."""
    ours = models[integration.IMPLEMENTATION]

    def plain(model: torch.nn.Module) -> Callable[[], object]:
        def forward() -> object:
            with torch.no_grad():
                return model(input_ids=ids)

        return forward

    def recorded(heads: list[int] | None) -> Callable[[], object]:
        def forward() -> object:
            with torch.no_grad(), capture(ours, layers=[LAYER], heads=heads) as rec:
                out = ours(input_ids=ids)
            return out, rec

        return forward

    def with_attentions() -> object:
        with torch.no_grad():
            return models["eager"](input_ids=ids, output_attentions=True)

    return {
        "multihead": plain(ours),
        "capture_1": recorded([HEAD]),
        "capture_h": recorded(None),
        "eager": plain(models["eager"]),
        "eager_attentions": with_attentions,
        "sdpa": plain(models["sdpa"]),
    }


def check(models: dict[str, torch.nn.Module], ids: torch.Tensor) -> dict:
    """The same answers before any timing: weights, logits; returns the largest differences seen."""
    ours = models[integration.IMPLEMENTATION]
    with torch.no_grad():
        eager = models["eager"](input_ids=ids, output_attentions=True)
        expected = eager.attentions[LAYER]  # (b, h, i, j)
        plain = ours(input_ids=ids).logits
        with capture(ours, layers=[LAYER], heads=[HEAD]) as one:
            one_logits = ours(input_ids=ids).logits
        with capture(ours, layers=[LAYER]) as every:
            every_logits = ours(input_ids=ids).logits
        sdpa = models["sdpa"](input_ids=ids).logits
    one_head = one.weights(LAYER, HEAD)  # (b, i, j)
    all_heads = every.weights(LAYER)  # (b, h, i, j)
    torch.testing.assert_close(one_head, expected[:, HEAD], atol=TOLERANCE, rtol=0, msg="capture, one head")
    torch.testing.assert_close(all_heads, expected, atol=TOLERANCE, rtol=0, msg="capture, every head")
    assert torch.equal(one_logits, plain) and torch.equal(every_logits, plain), "recording changed the logits"
    for name, logits in (("eager", eager.logits), ("sdpa", sdpa)):
        torch.testing.assert_close(plain, logits, atol=2e-4, rtol=2e-4, msg=name)
    return {
        "capture_1_vs_eager_weights": (one_head - expected[:, HEAD]).abs().max().item(),
        "capture_h_vs_eager_weights": (all_heads - expected).abs().max().item(),
        "capture_logits_changed": False,
        "multihead_vs_eager_logits": (plain - eager.logits).abs().max().item(),
        "multihead_vs_sdpa_logits": (plain - sdpa).abs().max().item(),
    }


def measure(n: int, rounds: int, block_s: float) -> dict:
    base = llama()
    models = {}
    for name in (integration.IMPLEMENTATION, "eager", "sdpa"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(name)
        models[name] = model
    ids = torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(n))
    load_before = load_average()
    checked = check(models, ids)
    steps = ways(models, ids)
    peak_mib = {}
    for name, step in steps.items():
        step()  # warm
        peak_mib[name], _, result = peak_memory(Call(step))
        del result
    samples = interleave(steps, rounds=rounds, block_s=block_s)
    row: dict = {
        "n": n,
        "load_average_1min": {"before": load_before, "after": load_average()},
        "check": checked,
        "peak_mib": peak_mib,
        "median_s": {name: statistics.median(times) for name, times in samples.items()},
        "samples_s": samples,
    }
    row["ratios"] = ratios_of(samples, RATIOS)
    return row


def ratios_of(samples: dict[str, list[float]], pairs) -> dict[str, dict[str, float]]:
    """Each ``top/bottom`` of ``pairs`` as the per-round ratio of their ``samples``: median, lowest, highest."""
    found = {}
    for top, bottom in pairs:
        per_round = [a / b for a, b in zip(samples[top], samples[bottom], strict=True)]
        found[f"{top}/{bottom}"] = {
            "median": statistics.median(per_round),
            "low": min(per_round),
            "high": max(per_round),
        }
    return found


def load_average() -> float | None:
    """The 1-minute load average (other processes on this machine disturb the timings), or None off Linux."""
    try:
        with open("/proc/loadavg") as text:
            return float(text.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def lscpu() -> dict:
    """The CPU's model name and flags as lscpu gives them ({} where it cannot run)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key: fields[key].strip() for key in ("Model name", "CPU(s)", "Flags") if key in fields}


def source_state() -> dict:
    """Where the multihead measured was imported from, its commit, and its files that differed from the commit."""
    package = Path(multihead.__file__).resolve().parent  # .../src/multihead

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    status = git("status", "--porcelain", "--", ".").splitlines()
    return {
        "imported_from": str(package),
        "commit": git("rev-parse", "HEAD").strip(),
        "src_changes": [line[3:] for line in status],
    }


def machine() -> dict:
    cpu = lscpu()
    ram = ram_bytes()
    return {
        "identity": identity().describe(),
        "lscpu_model": cpu.get("Model name"),
        "lscpu_cpus": cpu.get("CPU(s)"),
        "lscpu_flags": cpu.get("Flags"),
        "ram_gib": None if ram is None else round(ram / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "multihead": multihead.__version__,
        "python": platform.python_version(),
    }


def ratio_text(entry: dict) -> str:
    return "{median:.2f} ({low:.2f}–{high:.2f})".format(**entry)


def machine_line(m: dict) -> str:
    """The machine a result was measured on, in one line: CPU model, the vector flags lscpu lists, memory."""
    flags = set((m["lscpu_flags"] or "").split())
    shown = " ".join(flag for flag in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if flag in flags)
    return (
        f"Machine: {m['lscpu_model']} (lscpu flags: {shown or 'none of avx/avx2/fma/avx512f listed'}), "
        f"{m['lscpu_cpus']} CPUs, {m['ram_gib']} GiB; {m['identity']}; transformers {m['transformers']}."
    )


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        f"{results['model']}. Recorded: layer {LAYER}, head {HEAD}. {results['rounds']} interleaved rounds "
        f"of about {results['block_s']} s per way; times are medians over rounds, ratios the median of "
        "per-round ratios (lowest–highest). Peak memory: one call, MiB above the RSS before it.",
        "",
        "| n | " + " | ".join(f"({letter}) {label} s" for letter, label in WAYS.values()) + " |",
        "|---" * (len(WAYS) + 1) + "|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['n']} | " + " | ".join(f"{row['median_s'][name]:.4f}" for name in WAYS) + " |")
    lines += ["", "| n | " + " | ".join(f"({letter}) MiB" for letter, _ in WAYS.values()) + " |"]
    lines.append("|---" * (len(WAYS) + 1) + "|")
    for row in results["rows"]:
        peaks = [row["peak_mib"][name] for name in WAYS]
        lines.append(f"| {row['n']} | " + " | ".join("—" if p is None else f"{p:.0f}" for p in peaks) + " |")
    names = [f"({WAYS[top][0]}) / ({WAYS[bottom][0]})" for top, bottom in RATIOS]
    lines += ["", "| n | " + " | ".join(names) + " |", "|---" * (len(RATIOS) + 1) + "|"]
    for row in results["rows"]:
        cells = [ratio_text(row["ratios"][f"{top}/{bottom}"]) for top, bottom in RATIOS]
        lines.append(f"| {row['n']} | " + " | ".join(cells) + " |")
    lines += ["", "Checked before timing (largest absolute differences):", ""]
    for row in results["rows"]:
        c = row["check"]
        lines.append(
            f"- n = {row['n']}: capture vs eager's output_attentions {c['capture_1_vs_eager_weights']:.1e} "
            f"(one head), {c['capture_h_vs_eager_weights']:.1e} (every head); logits with and without "
            f"capture identical; multihead vs eager logits {c['multihead_vs_eager_logits']:.1e}, "
            f"vs sdpa {c['multihead_vs_sdpa_logits']:.1e}"
        )
    loads = "; ".join(
        f"n = {row['n']}: {row['load_average_1min']['before']} before, {row['load_average_1min']['after']} after"
        for row in results["rows"]
    )
    lines += ["", f"1-minute load average ({results['machine']['lscpu_cpus']} CPUs): {loads}."]
    state = results["source"]
    changes = ", ".join(state["src_changes"]) or "none"
    lines += ["", f"Source: commit {state['commit'][:10]}; uncommitted changes under src/ when run: {changes}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 128 and 256, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; --quick 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ensure_malloc_env()  # re-executes with MALLOC_MMAP_THRESHOLD_ set, for the memory call
    prepare_allocator(print)  # timed calls: glibc's mmap threshold at its dynamic maximum, as the harness does
    sizes, rounds, block_s = ((128, 256), 3, 0.2) if args.quick else ((512, 2048), 7, 1.0)
    rounds = args.rounds or rounds
    results = {
        "machine": machine(),
        "source": source_state(),
        "model": "random Llama (benchmarks/hf.py): 6 layers, hidden 256, 8 query heads over 2 key/value heads, "
        "float32, batch 1, forward under no_grad",
        "recorded": {"layer": LAYER, "head": HEAD},
        "ways": {name: f"({letter}) {label}" for name, (letter, label) in WAYS.items()},
        "rounds": rounds,
        "block_s": block_s,
        "rows": [],
    }
    for n in sizes:
        results["rows"].append(measure(n, rounds, block_s))
        print(f"n = {n} done", flush=True)
    save_results("hf_capture_quick" if args.quick else "hf_capture", results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

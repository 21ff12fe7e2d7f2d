"""The head browser's cost: time and peak memory of multihead.lab.inspect.browse_corpus over growing corpora.

Two models: all-MiniLM-L6-v2 (the bundled checkpoint), and a randomly initialised transformers GPT-2 of GPT-2
small's shape (12 layers, 12 heads, width 768, 1,024 positions; a byte-level BPE of 4,000 pieces trained here on the
corpus, so its embedding table is smaller than GPT-2's 50,257) saved and loaded from a local folder: nothing is
downloaded. Corpora: the first N of the bundled UD English EWT dev sentences (N = 250, 1,000 and 2,001), and for
GPT-2 also long documents (the sentences joined 200 at a time, about 5,000 pieces each), read in windows of its
1,024 positions.

Each run is a fresh process (the peak resident memory only grows within one): it loads the model, notes its
resident memory, browses, and reports the time and the peak resident memory above the loaded model. The memory
must not grow with N (what is kept per head is fixed: its top contexts, histograms and sample).

    python benchmarks/browse.py [--quick]      # writes benchmarks/results/browse.{json,md}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.common import save_results
from hf_capture import machine, machine_line, source_state

SIZES = (250, 1000, 2001)
LONG_DOCUMENTS = 4  # long documents of 200 sentences each, for the windowed path


def build_gpt2(folder: Path, sentences: list[str]) -> Path:
    """A random GPT-2-small-shaped checkpoint and a byte-level BPE trained on ``sentences``, saved in ``folder``."""
    import tokenizers
    import torch
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(sentences, vocab_size=4000, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CHILD = """
import json, resource, sys, time
import torch
torch.set_num_threads(2)
from multihead.integrations import load_text_model
from multihead.lab.inspect.browse import browse_corpus, bundled_documents
model_path, kind, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load_text_model(None if model_path == "minilm" else model_path)
sentences = bundled_documents()
if kind == "sentences":
    documents = sentences[:count]
else:
    documents = [" ".join(sentences[i * 200 : (i + 1) * 200]) for i in range(count)]
def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
loaded = rss_mib()
start = time.perf_counter()
found = browse_corpus(model, documents)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "loaded_mib": loaded, "peak_mib": peak, "queries": found.queries,
                  "documents": found.documents, "heads": len(found.heads)}))
"""


def run(model: str, kind: str, count: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model, kind, str(count)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def markdown(results: dict) -> str:
    lines = [
        machine_line(results["machine"]),
        "Each row one fresh process, 2 threads: browse_corpus with its defaults (top 8 contexts, 8 pieces each side, "
        "256 sampled pieces, windows batched 16 at a time within a 256 MiB budget of recorded weights). Peak above "
        "the model: the process's peak resident memory less its resident memory once the model was loaded.",
        "",
        "| model | corpus | documents | queries | seconds | queries/s | model loaded MiB | peak above the model MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['model']} | {row['corpus']} | {row['documents']:,} | {row['queries']:,} | {row['seconds']:.1f} | "
            f"{row['queries'] / row['seconds']:,.0f} | {row['loaded_mib']:,.0f} | "
            f"{row['peak_mib'] - row['loaded_mib']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="corpora of 50 and 100 sentences, one long document")
    args = parser.parse_args(argv)
    sizes, long_documents = ((50, 100), 1) if args.quick else (SIZES, LONG_DOCUMENTS)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        from multihead.lab.inspect.browse import bundled_documents

        gpt2 = str(build_gpt2(Path(folder) / "gpt2-small-shape", bundled_documents()))
        for model, name in (("minilm", "all-MiniLM-L6-v2"), (gpt2, "GPT-2 small shape (random)")):
            for count in sizes:
                rows.append({"model": name, "corpus": f"{count:,} UD sentences", **run(model, "sentences", count)})
                print(rows[-1], flush=True)
        found = run(gpt2, "long", long_documents)
        rows.append({"model": "GPT-2 small shape (random)", "corpus": f"{long_documents} long documents", **found})
        print(rows[-1], flush=True)
    results = {"machine": machine(), "source": source_state(), "rows": rows}
    save_results("browse_quick" if args.quick else "browse", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Attention kernel benchmark: a thin script around multihead.bench.kernel (see its docstring).

Usage:
    python benchmarks/kernel.py [--quick] [--budget-s 120] [--out benchmarks/results]
                                [--sizes 256,1024,4096,16384] [--dtypes float32,bfloat16]

Re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 (multihead.bench.common.ensure_malloc_env) before
measuring; writes kernel.json, .md and .png (kernel_quick.* with --quick) under benchmarks/results.
"""

import sys
from pathlib import Path

from multihead.bench.kernel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], default_out=Path(__file__).resolve().parent / "results"))

"""Attention kernel benchmark: a thin script around harness.kernel (see its docstring).

Usage:
    python benchmarks/kernel.py [--quick] [--budget-s 120] [--out benchmarks/results]
                                [--sizes 256,1024,4096,16384] [--dtypes float32,bfloat16]

Re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 (harness.common.ensure_malloc_env) before
measuring; writes kernel.json, .md and .png (kernel_quick.* with --quick) under benchmarks/results.
"""

import sys

from harness.kernel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

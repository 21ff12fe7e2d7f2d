"""Attention layer benchmark: a thin script around harness.layer (see its docstring).

Usage:
    python benchmarks/layer.py [--quick] [--budget-s 60] [--out benchmarks/results]
                               [--sizes 128,512,2048] [--dtypes float32,bfloat16]

Re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 (harness.common.ensure_malloc_env) before
measuring; writes layer.json, .md and .png (layer_quick.* with --quick) under benchmarks/results.
"""

import sys

from harness.layer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Both benchmarks, then every case scored against this machine's roofline: a thin script around harness.suite.

Usage:
    python benchmarks/suite.py [--quick] [--only kernel|layer] [--out benchmarks/results]
    python benchmarks/suite.py --rescore [--quick] [--only kernel|layer] [--out benchmarks/results]

Writes the benchmarks' own reports and bench.json, .md and .png (bench_quick.* with --quick); --rescore
runs nothing and scores the kernel.json and layer.json already in --out against today's calibration.
"""

import sys

from harness.suite import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

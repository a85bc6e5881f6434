#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_batching.py --help` (logic in jaxserve/bench/batching.py)."""
import sys

from jaxserve.bench.batching import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_buckets.py --help` (logic in jaxserve/bench/buckets.py)."""
import sys

from jaxserve.bench.buckets import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

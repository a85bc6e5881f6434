#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_serving.py --help` (logic in jaxserve/bench/serving.py)."""
import sys

from jaxserve.bench.serving import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

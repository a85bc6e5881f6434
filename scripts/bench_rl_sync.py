#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_rl_sync.py --help` (logic in jaxserve/bench/rl_sync.py)."""
import sys

from jaxserve.bench.rl_sync import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

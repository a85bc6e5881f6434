"""POST /reset_prefix_cache (vLLM's route; `jaxserve bench compare` uses it so that every
case on a reused server starts cold): the cached prefix blocks of a finished request are
dropped, and a second reset finds none."""

from __future__ import annotations

import httpx

from .helpers import MODEL


def test_reset_prefix_cache_frees_the_cached_blocks(server):
    prompt = "the quick brown fox jumps over the lazy dog"  # 43 tokens: 10 blocks of 4
    r = httpx.post(server.url("/v1/completions"), timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url("/reset_prefix_cache"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["blocks_freed"] >= 5
    r = httpx.post(server.url("/reset_prefix_cache"), timeout=30)
    assert r.json() == {"blocks_freed": 0}

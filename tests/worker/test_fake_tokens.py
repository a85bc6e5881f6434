"""The fake device's tokens: `default_tokens` (a whole step's, hashed in NumPy) equals
`default_token` (one at a time, the tests' reference) and stays in [low, vocab_size)."""

from __future__ import annotations

import random

import numpy as np

from jaxserve.worker.fake_runner import default_token, default_tokens


def test_a_steps_tokens_at_once_equal_one_at_a_time():
    rng = random.Random(7)
    ids = [f"req-{rng.random():.6f}#{rng.randrange(4)}" for _ in range(300)] + ["r", ""]
    pos = [rng.randrange(0, 2**31) for _ in ids[:-2]] + [0, 2**31 - 1]
    for vocab, low in ((1000, 3), (98, 3), (49152, 0), (5, 4)):
        got = default_tokens(ids, pos, vocab_size=vocab, low=low)
        assert got.tolist() == [default_token(r, p, vocab_size=vocab, low=low)
                                for r, p in zip(ids, pos)]
        assert got.min() >= low and got.max() < vocab
    # a request's tokens spread over the vocabulary (not a constant, not a short cycle)
    seq = [default_token("r0", p) for p in range(400)]
    assert len(set(seq)) > 250 and np.diff(seq).any()
    assert default_tokens([], []).shape == (0,)

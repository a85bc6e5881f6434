"""Chat `logprobs` carry each token's real bytes (issue 30, item 4).

A FakeRunner engine with SmolLM2's real byte-level tokenizer (from the GGUF header, no
weights) emits the tokens of a text whose CJK characters and emoji are split over
several tokens. The reference is the text's own UTF-8: the `bytes` lists must join to
it, streamed and not; a token that leaves a character unfinished reports `token` ""
and the one that finishes it the whole character (vLLM's V1 logprobs convention).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.worker.fake_runner import FakeRunner, SampledToken

from .helpers import MODEL, SERVER_DEFAULTS, running_server

GGUF = Path(__file__).resolve().parents[2] / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "Hi 世界😀!"
pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not downloaded")


@pytest.fixture(scope="module")
def server():
    from jaxserve.checkpoint.gguf_loader import read_gguf_header

    _, _, tok = read_gguf_header(GGUF)
    ids = tok.encode(TEXT)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 6  # the characters are split

    def token_fn(req, pos):  # TEXT's tokens, then EOS; the top alternative is the token
        t = ids[pos] if pos < len(ids) else tok.eos_token_id
        return SampledToken(token_id=t, logprob=-0.5, top_ids=np.array([t], np.int32),
                            top_logprobs=np.array([-0.5], np.float32))

    model = ModelConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=512)
    config = make_engine_config(model, **dict(SERVER_DEFAULTS, max_model_len=256))
    runner = FakeRunner.for_config(config, token_fn=token_fn, step_delay=0.001)
    with running_server(LLMEngine(config, tokenizer=tok, runner=runner, model_name=MODEL)) as srv:
        yield srv, len(ids)


def _body(n, stream):
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": n,
            "logprobs": True, "top_logprobs": 1, "stream": stream}


def _check(content):
    assert bytes(b for e in content for b in e["bytes"]) == TEXT.encode()
    assert [e["token"] for e in content] == ["Hi", " ", "", "世", "", "", "界", "", "", "😀", "!"]
    assert "".join(e["token"] for e in content) == TEXT
    for e in content:
        assert e["top_logprobs"] == [{"token": e["token"], "logprob": -0.5, "bytes": e["bytes"]}]


def test_chat_logprob_bytes(server):
    srv, n = server
    r = httpx.post(srv.url("/v1/chat/completions"), json=_body(n, False), timeout=30).json()
    assert r["choices"][0]["message"]["content"] == TEXT
    _check(r["choices"][0]["logprobs"]["content"])


def test_chat_logprob_bytes_streamed(server):
    srv, n = server
    content, text = [], ""
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json=_body(n, True),
                      timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"]
            if ch and ch[0]["logprobs"]:
                content += ch[0]["logprobs"]["content"]
            text += ch[0]["delta"].get("content", "") if ch else ""
    assert text == TEXT
    _check(content)

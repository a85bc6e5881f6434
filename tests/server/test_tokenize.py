"""POST /tokenize and /detokenize: vLLM's shapes, against the tokenizer's own ids.

Expected ids are hand-written for the tiny character tokenizer (see
helpers.py: 3 ' ', 4..29 a-z, 1 <s>) and taken from transformers' golden
file for the real SmolLM2 tokenizer. Runs on both engine kinds.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from conftest import TINY_CHAT_TEMPLATE, tiny_tokenizer

from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.worker.fake_runner import FakeRunner

from .helpers import MODEL, healthy_probe, running_server

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOLDEN = ROOT / "tests" / "fixtures" / "smollm2" / "tokenizer_golden.json"
CONTINUE_GOLDEN = GOLDEN.with_name("continue_final_golden.json")


def _ids(word: str) -> list[int]:
    """Tiny-tokenizer ids by hand: ' ' 3, a-z 4..29."""
    return [3 if c == " " else 4 + ord(c) - ord("a") for c in word]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=30)


def test_tokenize_text_prompt(server):
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "ab c", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 4, "max_model_len": 64, "tokens": [4, 5, 3, 6],
                        "token_strs": ["a", "b", " ", "c"]}
    assert r.json()["tokens"] == tiny_tokenizer().encode("ab c", add_special_tokens=True)


def test_tokenize_chat_matches_the_chat_endpoints_prompt(server):
    messages = [{"role": "user", "content": "hi"}]
    r = _post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    # TINY_CHAT_TEMPLATE: "<s>user hi" + generation prompt "<s>assistant ".
    want = [1] + _ids("user hi") + [1] + _ids("assistant ")
    assert r.json() == {"count": len(want), "max_model_len": 64, "tokens": want,
                        "token_strs": None}
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(want)

    no_gen = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_gen.json()["tokens"] == [1] + _ids("user hi")


def test_tokenize_continue_final_message_and_special_tokens(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    r = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                    "continue_final_message": True})
    assert r.json()["tokens"] == [1] + _ids("user hi") + [1] + _ids("assistant yo")
    assert TINY_CHAT_TEMPLATE.endswith("{% endif %}")  # nothing follows the content to cut


def test_detokenize_round_trip_keeps_special_tokens(server):
    ids = [1] + _ids("ab c")
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "<s>ab c"}
    back = _post(server, "/tokenize", {"prompt": r.json()["prompt"]}).json()["tokens"]
    assert back == ids


BAD = [
    ("/tokenize", {"prompt": 3}, "prompt", "valid string"),
    ("/tokenize", {}, "prompt", "Field required"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model", "does not exist"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ("/tokenize", {"messages": []}, "messages", "empty"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, "continue_final_message",
     "add_generation_prompt=true and continue_final_message=true"),
    ("/detokenize", {"tokens": [1, 67]}, "tokens", "tokens[1]=67: must be a token id in "
     "[0, vocab_size=67)"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0]=-1"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "valid list"),
    ("/detokenize", {"tokens": [True]}, "tokens", "valid integer"),
]


@pytest.mark.parametrize("path,body,param,text", BAD, ids=[f"{p}-{i}" for i, (p, *_)
                                                            in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param, text):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    healthy_probe(server)


@pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not downloaded")
def test_smollm2_tokenizer_golden():
    """The real tokenizer behind the routes gives transformers' ids (golden fixture)."""
    from jaxserve.checkpoint.gguf_loader import read_gguf_header

    _, cfg, tok = read_gguf_header(GGUF)
    golden = json.loads(GOLDEN.read_text())
    model = ModelConfig.tiny(vocab_size=cfg.vocab_size, max_position_embeddings=2048)
    config = make_engine_config(model, max_model_len=2048, block_size=16, num_kv_blocks=129,
                                max_num_seqs=4, max_num_batched_tokens=64)
    # Steps never run here: the fake runner stands in for a model the routes never call.
    engine = LLMEngine(config, tokenizer=tok, runner=FakeRunner.for_config(config),
                       model_name=MODEL)
    with running_server(engine) as srv:
        for case in golden["plain"]:
            r = _post(srv, "/tokenize", {"prompt": case["text"], "add_special_tokens": False})
            assert r.json()["tokens"] == case["ids"], case["text"]
        for case in golden["chat"]:
            r = _post(srv, "/tokenize", {"messages": case["messages"]})
            assert r.json()["tokens"] == case["ids"]
            d = _post(srv, "/detokenize", {"tokens": case["ids"]})
            assert d.json() == {"prompt": case["text"]}
        for case in json.loads(CONTINUE_GOLDEN.read_text())["cases"]:
            r = _post(srv, "/tokenize", {"messages": case["messages"], "add_generation_prompt": False,
                                         "continue_final_message": True})
            assert r.json()["tokens"] == tok.encode(case["text"], add_special_tokens=False)


@pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not downloaded")
def test_continue_final_message_matches_transformers():
    """Issue 30 item 3: the text ends exactly where the final content ends, as
    transformers renders it (fixture by scripts/make_chat_template_golden.py): a
    trailing space or newline kept, an empty final message leaves the turn open,
    a final "end" is not matched inside "<|im_end|>"."""
    from jaxserve.checkpoint.gguf_loader import read_gguf_header
    from jaxserve.server.serving_tokens import continue_final_message

    _, _, tok = read_gguf_header(GGUF)
    cases = json.loads(CONTINUE_GOLDEN.read_text())["cases"]
    assert any(c["messages"][-1]["content"] == "end" for c in cases)
    for case in cases:
        assert continue_final_message(tok, case["messages"]) == case["text"], case["messages"]

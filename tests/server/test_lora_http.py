"""LoRA over HTTP (issue 27): vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
behind the API key and --allowed_weights_dir, /v1/models listing the adapters, and a
request whose `model` names an adapter served by it (greedy tokens equal a plain decode
of the hand-merged weights)."""

from __future__ import annotations

import asyncio
import functools

import httpx
import numpy as np
import pytest

from conftest import tiny_engine, tiny_params
from lora.helpers import merged_params, random_adapter
from lora.peft_dir import write_peft_dir

from jaxserve.model.llama import reference_logits

from .helpers import MODEL, fake_only, running_server

KEY = "k27"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 9, 14, 3, 20, 21]


def _greedy_merged(tree, n):
    cfg, params = tiny_params()
    merged = merged_params(params, tree)
    seq = list(PROMPT)
    for _ in range(n):
        seq.append(int(np.argmax(reference_logits(cfg, merged, np.array(seq))[-1])))
    return seq[len(PROMPT):]


def _complete(srv, model):
    r = httpx.post(srv.url("/v1/completions"), headers=AUTH, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0})
    return r


def _ids(srv, r):
    tok = srv.engine.tokenizer
    return [tok.encode(t, add_special_tokens=False)[0]
            for t in r.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.parametrize("engine_process", [False, pytest.param(True, marks=fake_only)],
                         ids=["thread", "process"])
def test_load_serve_unload_adapter(tmp_path, engine_process):
    cfg, _ = tiny_params()
    tree = random_adapter(cfg, 4, seed=70, targets=["wq", "wv", "w_down"])
    allowed = tmp_path / "allowed"
    write_peft_dir(allowed / "a1", tree, rank=4)
    write_peft_dir(allowed / "big", random_adapter(cfg, 17, seed=71), rank=17)
    write_peft_dir(tmp_path / "outside", tree, rank=4)
    # In its own process the engine is built there; the adapters' names come back with
    # each call's result (`EngineView.lora`).
    eng = functools.partial(tiny_engine, max_loras=2, max_lora_rank=16)
    with running_server(eng if engine_process else eng(), api_key=KEY,
                        allowed_weights_dir=str(allowed), engine_process=engine_process) as srv:
        post = lambda route, body: httpx.post(srv.url(route), headers=AUTH, json=body,  # noqa
                                              timeout=60)
        r = post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "a1"})
        assert r.status_code == 200, r.text
        models = httpx.get(srv.url("/v1/models"), headers=AUTH).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(MODEL, None), ("sql", MODEL)]
        r = _complete(srv, "sql")
        assert r.status_code == 200, r.text
        assert _ids(srv, r) == _greedy_merged(tree, 5)
        assert _ids(srv, _complete(srv, MODEL)) == _greedy_merged({"scaling": 1.0}, 5)
        r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "outside")})
        assert r.status_code == 403 and "outside --allowed_weights_dir" in r.text
        r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "big"})
        assert r.status_code == 400 and "exceeds max_lora_rank=16" in r.text, r.text
        r = post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "a1"})
        assert r.status_code == 409
        r = post("/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status_code == 200, r.text
        assert _complete(srv, "sql").status_code == 400  # model_not_found
        assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
        assert not srv.engine.lora.list_loras()  # the engine's (or the process's view)
        ae = srv.async_engine  # and the engine's own list, asked through a call
        names = asyncio.run_coroutine_threadsafe(
            ae.call(lambda e: [r.lora_name for r in e.lora.list_loras()]), ae._loop).result(30)
        assert names == []


def test_lora_routes_need_the_api_key():
    eng = tiny_engine(max_loras=2, max_lora_rank=16)
    with running_server(eng) as srv:
        r = httpx.post(srv.url("/v1/load_lora_adapter"), json={"lora_name": "a", "lora_path": "b"})
        assert r.status_code == 404

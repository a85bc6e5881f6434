"""POST /admin/update_weights_from_disk (jaxserve.server.admin) on a real tiny engine.

Checkpoints are written in the test: a copy of the tiny_untied HF fixture (weights A)
and the same architecture with perturbed tensors (weights B, safetensors written
here). After the update, greedy completions equal a plain, non-paged greedy decode of
B (`reference_logits`); a checkpoint of another shape is a 400 and A keeps serving.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxserve.checkpoint import load_model
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.model.llama import reference_logits

from .helpers import running_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """allowed/ holds A (the fixture) and B (perturbed, written here); outside/ holds C."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("weights")
    allowed = root / "allowed"
    shutil.copytree(FIXTURES / "tiny_untied", allowed / "A")
    shutil.copytree(FIXTURES / "tiny_untied", allowed / "B")
    t = load_file(str(allowed / "B" / "model.safetensors"))
    rng = np.random.default_rng(0)
    t = {k: (v + 0.5 * rng.standard_normal(v.shape).astype(v.dtype)) if v.ndim == 2 else v
         for k, v in t.items()}
    save_file(t, str(allowed / "B" / "model.safetensors"))
    shutil.copytree(FIXTURES / "tiny_qwen2", allowed / "other_shape")
    shutil.copytree(FIXTURES / "tiny_untied", root / "outside")
    (allowed / "escape").symlink_to(root / "outside")  # a directory symlink out
    shutil.copytree(FIXTURES / "tiny_untied", allowed / "sneaky")
    (allowed / "sneaky" / "model.safetensors").unlink()
    (allowed / "sneaky" / "model.safetensors").symlink_to(root / "outside" / "model.safetensors")
    return allowed


@pytest.fixture(scope="module")
def engine(ckpts):
    cfg, params, tok = load_model(ckpts / "A", cache_dir=None, progress=False)
    config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,),
                                seq_buckets=(2,), attention_backend="xla", strict_compiles=True,
                                enable_prompt_logprobs=False)
    return LLMEngine(config, params, tok, model_name="m", progress=False)


def greedy_reference(path: Path, n: int) -> list[int]:
    cfg, params, _ = load_model(path, cache_dir=None, progress=False)
    seq = list(PROMPT)
    for _ in range(n):
        seq.append(int(np.argmax(reference_logits(cfg, params, np.array(seq))[-1])))
    return seq[len(PROMPT):]


def complete(srv) -> list[int]:
    r = httpx.post(srv.url("/v1/completions"), headers=AUTH, timeout=60, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    toks = r.json()["choices"][0]["logprobs"]["tokens"]
    tok = srv.engine.tokenizer
    return [tok.encode(t, add_special_tokens=False)[0] for t in toks]


def update(srv, path: str, headers=AUTH):
    return httpx.post(srv.url("/admin/update_weights_from_disk"), headers=headers,
                      json={"model_path": path}, timeout=120)


def test_route_exists_only_with_an_api_key(engine, ckpts):
    with running_server(engine, served_model_name="m") as srv:
        assert update(srv, str(ckpts / "B")).status_code == 404
    with running_server(engine, served_model_name="m", api_key=KEY) as srv:
        r = update(srv, str(ckpts / "B"))
        assert r.status_code == 403 and "--allowed_weights_dir" in r.json()["error"]["message"]
        assert update(srv, str(ckpts / "B"), headers={}).status_code == 401


def test_update_swaps_weights_and_refuses_paths_outside(engine, ckpts, monkeypatch):
    root = str(ckpts.resolve())
    with running_server(engine, served_model_name="m", api_key=KEY,
                        allowed_weights_dir=str(ckpts)) as srv:
        assert complete(srv) == greedy_reference(ckpts / "A", 4)
        assert greedy_reference(ckpts / "A", 4) != greedy_reference(ckpts / "B", 4)
        built0 = engine.runner.stats().programs_built
        for bad in (str(ckpts.parent / "outside"), "escape", "../outside", "sneaky"):
            r = update(srv, bad)
            assert r.status_code == 403, r.text
            msg = r.json()["error"]["message"]
            assert repr(bad) in msg and root in msg and "outside --allowed_weights_dir" in msg
        r = update(srv, "missing")
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        r = update(srv, "other_shape")  # a Qwen2 of other shapes: named leaf, old weights kept
        assert r.status_code == 400 and "other_shape" in r.json()["error"]["message"]
        assert complete(srv) == greedy_reference(ckpts / "A", 4)

        r = update(srv, "B")  # relative to the allowed dir
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] and body["weight_version"] == engine.weight_version
        assert complete(srv) == greedy_reference(ckpts / "B", 4)
        assert engine.runner.stats().programs_built == built0  # no recompilation

        # One update at a time: a second one while the first is loading is a 409.
        import jaxserve.checkpoint as ckpt

        gate = threading.Event()

        def slow_load(*a, **kw):
            gate.wait(30)
            return load_model(*a, **kw)

        monkeypatch.setattr(ckpt, "load_model", slow_load)
        first: dict = {}
        th = threading.Thread(target=lambda: first.setdefault("r", update(srv, "A")))
        th.start()
        time.sleep(0.5)
        second = update(srv, "A")
        gate.set()
        th.join(60)
        assert second.status_code == 409 and "in progress" in second.json()["error"]["message"]
        assert first["r"].status_code == 200
        assert complete(srv) == greedy_reference(ckpts / "A", 4)


def test_update_inside_a_pause_serves_waiting_requests_the_new_weights(engine, ckpts):
    """Pause ("keep"), queue a completion (it waits), load B, resume: the completion is
    B's greedy decode. The route's `in_flight` mode is checked before anything loads."""
    with running_server(engine, served_model_name="m", api_key=KEY,
                        allowed_weights_dir=str(ckpts)) as srv:
        r = httpx.post(srv.url("/admin/update_weights_from_disk"), headers=AUTH, timeout=60,
                       json={"model_path": "B", "in_flight": "drop"})
        assert r.status_code == 400 and "'drop'" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "in_flight"
        assert complete(srv) == greedy_reference(ckpts / "A", 4)  # nothing changed
        assert httpx.post(srv.url("/admin/pause"), headers=AUTH,
                          json={"mode": "keep"}).status_code == 200
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("toks", complete(srv)))
        th.start()
        deadline = time.monotonic() + 10
        while srv.async_engine.stats.get("num_waiting") != 1:
            assert time.monotonic() < deadline, "the completion was not queued"
            time.sleep(0.01)
        r = httpx.post(srv.url("/admin/update_weights_from_disk"), headers=AUTH, timeout=60,
                       json={"model_path": "B", "in_flight": "retract"})
        assert r.status_code == 200, r.text
        assert "toks" not in box and httpx.get(srv.url("/health")).json()["paused"] is True
        assert httpx.post(srv.url("/admin/resume"), headers=AUTH).status_code == 200
        th.join(60)
        assert box["toks"] == greedy_reference(ckpts / "B", 4)
        r = update(srv, "A")  # in_flight defaults to "abort"; nothing in flight
        assert r.status_code == 200 and complete(srv) == greedy_reference(ckpts / "A", 4)


def _engine_of(path: Path) -> LLMEngine:
    cfg, params, tok = load_model(path, cache_dir=None, progress=False)
    config = make_engine_config(cfg, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,),
                                seq_buckets=(2,), attention_backend="xla",
                                enable_prompt_logprobs=False)
    return LLMEngine(config, params, tok, model_name="m", progress=False)


def test_update_reaches_an_engine_in_its_own_process(ckpts):
    """engine_process=True: the loaded tree crosses to the engine process with the call."""
    import functools

    with running_server(functools.partial(_engine_of, ckpts / "A"), served_model_name="m",
                        api_key=KEY, allowed_weights_dir=str(ckpts), engine_process=True) as srv:
        assert complete(srv) == greedy_reference(ckpts / "A", 4)
        r = update(srv, "B")
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == 1
        assert complete(srv) == greedy_reference(ckpts / "B", 4)
        r = update(srv, "other_shape")  # the engine's ValueError, raised in its process
        assert r.status_code == 400 and "other_shape" in r.json()["error"]["message"]
        assert complete(srv) == greedy_reference(ckpts / "B", 4)

"""Server test helpers: a real uvicorn server on 127.0.0.1 in a background thread.

The server always runs a real `LLMEngine` with the tiny character tokenizer
of tests/conftest.py; what executes the steps is swappable:
`JAXSERVE_SERVER_TEST_ENGINE=fake` (default) uses the `FakeRunner` with
`counting_token` (hand-checkable tokens, milliseconds per step); `=tiny` uses
the real tiny-model `ModelRunner`. Tests whose expected values come from the
fake's arithmetic are marked `fake_only` and skipped for the real runner.

The tiny vocabulary (67 ids): 0 <pad>, 1 <s>, 2 </s> (EOS), 3 ' ', 4..29 a-z,
30..55 A-Z, 56..65 0-9, 66 <unk>; so greedy counting from "abc" reads "defgh".
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from conftest import tiny_tokenizer  # the module object pytest loaded: one tokenizer/engine cache
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.worker.fake_runner import FakeRunner, counting_token
from jaxserve.server import JaxserveServer, build_app

ENGINE_KIND = os.environ.get("JAXSERVE_SERVER_TEST_ENGINE", "fake")
MODEL = "fake-model"
SERVER_DEFAULTS = dict(max_model_len=64, block_size=4, num_kv_blocks=257, max_num_seqs=16,
                       max_num_batched_tokens=32)


def _prompt_has(marker: str):
    tok = tiny_tokenizer()
    return lambda req: marker in tok.decode(req.prompt_token_ids)


def fake_engine(*, step_delay: float = 0.001, **engine_args: Any) -> LLMEngine:
    """A real `LLMEngine` over the `FakeRunner` (no model): counting tokens, and fault
    injection: a prompt containing "STEPFAIL" makes its steps raise, one containing
    "REQFAIL" fails that request alone (a row error)."""
    args = dict(SERVER_DEFAULTS, **engine_args)
    model = ModelConfig.tiny(max_position_embeddings=max(512, args["max_model_len"]))
    config = make_engine_config(model, **args)
    runner = FakeRunner.for_config(
        config, token_fn=counting_token(model.vocab_size, config.max_logprobs),
        step_delay=step_delay, fail_step=_prompt_has("STEPFAIL"), fail_row=_prompt_has("REQFAIL"))
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, model_name=MODEL)


def make_engine(**cfg: Any):
    """An engine of the selected kind; `cfg` are engine arguments (and `step_delay`)."""
    if ENGINE_KIND == "fake":
        return fake_engine(**cfg)
    from conftest import tiny_engine

    cfg.pop("step_delay", None)
    return tiny_engine(**dict(SERVER_DEFAULTS, **cfg))


class LiveServer:
    """A running server: `url(path)`, `.engine` (the raw engine), `.app`."""

    def __init__(self, app, engine, sock: socket.socket):
        self.app = app
        self.engine = engine
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3,
                                lifespan="on")
        self.server = JaxserveServer(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def async_engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "server thread did not exit"


@contextlib.contextmanager
def running_server(engine_or_factory, *, wait_ready: bool = True, **app_kw):
    """Start build_app(engine) under uvicorn on a free port; stop it on exit."""
    app_kw.setdefault("served_model_name", MODEL)
    app = build_app(engine_or_factory, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    srv = LiveServer(app, engine_or_factory, sock)
    srv.thread.start()
    try:
        deadline = time.monotonic() + 20
        while not srv.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        if wait_ready:  # an engine process (engine_process=True) imports jax and compiles
            deadline = time.monotonic() + 120
            while httpx.get(srv.url("/health")).status_code != 200:
                assert time.monotonic() < deadline, "engine did not become ready"
                time.sleep(0.02)
            srv.engine = srv.async_engine.engine
        yield srv
    finally:
        srv.stop()


def metrics_values(text: str) -> dict[str, float]:
    """Flatten a /metrics exposition into {'name{labels}': value} via prometheus' parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(srv: LiveServer, baseline_free: float, timeout: float = 5.0) -> dict[str, float]:
    """Poll /metrics until 0 running, 0 waiting and free blocks == baseline; return the values."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_values(httpx.get(srv.url("/metrics")).text)
        ok = (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
              and m["jaxserve:num_free_blocks"] == baseline_free)
        if ok or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def healthy_probe(srv: LiveServer) -> None:
    """The healthy-afterwards probe: a normal completion succeeds with the asked length."""
    r = httpx.post(srv.url("/v1/completions"), json={
        "model": MODEL, "prompt": "probe", "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


fake_only = pytest.mark.skipif(ENGINE_KIND != "fake",
                               reason="expected values come from the FakeRunner's arithmetic")

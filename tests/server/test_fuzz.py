"""API fuzz: schemathesis against the app's own OpenAPI schema, every route, both modes.

Property: no input produces a 5xx (the documented 503s of warm-up, shutdown and
overload cannot occur here: the engine is ready and the queue unbounded), and
afterwards /health and a normal request still work with nothing leaked.
Positive cases fit the schema (so they reach the validator and the engine);
negative cases break it (wrong types, missing fields, out-of-schema values).

Bounded for `make test`: JAXSERVE_FUZZ_EXAMPLES examples per (route, mode),
default 15 (~1 s per route on the fake runner). `make fuzz` runs a long profile
with a larger value.
"""

from __future__ import annotations

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from jaxserve.server import build_app  # noqa: E402

from .helpers import healthy_probe, metrics_values, wait_idle  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("JAXSERVE_FUZZ_EXAMPLES", "15"))


def _operations():
    # The schema is the app's own: an app that is never started serves it as well.
    schema = schemathesis.openapi.from_dict(build_app(lambda: None).openapi())
    return [r.ok() for r in schema.get_all_operations()]


OPERATIONS = _operations()


def test_the_schema_covers_every_route():
    labels = {op.label for op in OPERATIONS}
    assert labels == {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
                      "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
                      "POST /reset_prefix_cache"}


def test_the_schema_covers_the_tool_and_reasoning_fields():
    """Issue 29's fields are in the schema, so the fuzz generates them (nested too)."""
    schemas = build_app(lambda: None).openapi()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"} <= set(chat)
    assert {"tool_calls", "tool_call_id", "reasoning", "reasoning_content"} <= set(
        schemas["ChatMessage"]["properties"])
    assert {"name", "parameters"} <= set(schemas["FunctionDefinition"]["properties"])
    assert {"tools", "chat_template_kwargs"} <= set(
        schemas["TokenizeChatRequest"]["properties"])


# A route without parameters or body has no negative case (schemathesis finds none).
NO_BODY = {"POST /reset_prefix_cache"}
CASES = [(op, mode) for op in OPERATIONS
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or (op.method == "post" and op.label not in NO_BODY)]


@pytest.mark.parametrize("op,mode", CASES, ids=[f"{op.label}-{m.value}" for op, m in CASES])
def test_no_input_gives_a_5xx(server, op, mode):
    baseline = metrics_values(httpx.get(server.url("/metrics")).text)["jaxserve:num_free_blocks"]
    seen: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        r = case.call(base_url=server.base_url, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (case.as_curl_command(), r.status_code, r.text[:500])
        if r.status_code >= 400 and op.path.startswith("/v1/"):
            err = r.json()["error"]  # OpenAI's error shape, always
            assert err["message"] and err["type"], err

    run()
    assert seen, "no example ran"
    if mode is GenerationMode.NEGATIVE and op.method == "post":
        assert any(400 <= s < 500 for s in seen), seen  # negative bodies were refused
    m = wait_idle(server, baseline, timeout=30)
    assert m["jaxserve:num_free_blocks"] == baseline, "the fuzz leaked KV blocks"
    assert httpx.get(server.url("/health")).status_code == 200
    healthy_probe(server)

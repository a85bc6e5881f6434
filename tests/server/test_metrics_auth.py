"""/metrics parses and moves as expected; api_key guards /v1 only; startup banner."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.server import build_app, format_startup_banner

from .helpers import MODEL, make_engine, metrics_values, running_server


def _metrics(srv) -> dict[str, float]:
    return metrics_values(httpx.get(srv.url("/metrics")).text)


def test_metrics_parse_and_counters_move(server):
    text = httpx.get(server.url("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [
        ("jaxserve:num_requests_running", "gauge"), ("jaxserve:num_requests_waiting", "gauge"),
        ("jaxserve:kv_cache_usage_perc", "gauge"), ("jaxserve:num_free_blocks", "gauge"),
        ("jaxserve:prompt_tokens", "counter"), ("jaxserve:generation_tokens", "counter"),
        ("jaxserve:num_preemptions", "counter"), ("jaxserve:prefix_cache_queries", "counter"),
        ("jaxserve:prefix_cache_hits", "counter"), ("jaxserve:bucket_steps", "counter"),
        ("jaxserve:bucket_real_tokens", "counter"), ("jaxserve:bucket_padded_tokens", "counter"),
        ("jaxserve:warmup_seconds", "gauge"), ("jaxserve:num_compiles_after_warmup", "counter"),
        ("jaxserve:time_to_first_token_seconds", "histogram"),
        ("jaxserve:inter_token_latency_seconds", "histogram"),
        ("jaxserve:e2e_request_latency_seconds", "histogram"),
        ("jaxserve:request_queue_time_seconds", "histogram"),
        ("jaxserve:iteration_tokens_total", "histogram"),
    ]:
        assert fams[name].type == kind, name

    before = _metrics(server)
    n_req, max_tokens = 3, 5
    prompt_tokens = completion_tokens = 0
    for i in range(n_req):
        r = httpx.post(server.url("/v1/completions"), json={
            "model": MODEL, "prompt": f"metric {i}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "n": 2}).json()
        prompt_tokens += r["usage"]["prompt_tokens"]
        completion_tokens += r["usage"]["completion_tokens"]
    after = _metrics(server)

    def delta(k):
        return after.get(k, 0.0) - before.get(k, 0.0)

    assert completion_tokens == n_req * 2 * max_tokens
    assert delta("jaxserve:generation_tokens_total") == completion_tokens
    assert delta("jaxserve:prompt_tokens_total") == prompt_tokens
    assert delta('jaxserve:request_success_total{finished_reason=length}') == n_req
    assert delta("jaxserve:e2e_request_latency_seconds_count") == n_req
    assert delta("jaxserve:time_to_first_token_seconds_count") == n_req
    # one gap per token after the first, sample 0 only
    assert delta("jaxserve:inter_token_latency_seconds_count") == n_req * (max_tokens - 1)
    assert delta("jaxserve:request_queue_time_seconds_count") == n_req
    steps = delta("jaxserve:iteration_tokens_total_count")
    assert steps >= max_tokens
    real = sum(v for k, v in after.items() if k.startswith("jaxserve:bucket_real_tokens_total")) - \
        sum(v for k, v in before.items() if k.startswith("jaxserve:bucket_real_tokens_total"))
    assert real == delta("jaxserve:iteration_tokens_total_sum")
    assert after["jaxserve:num_requests_running"] == 0
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0


def test_each_app_has_its_own_registry():
    a = build_app(make_engine(), served_model_name=MODEL)
    b = build_app(make_engine(), served_model_name=MODEL)
    assert a.state.metrics.registry is not b.state.metrics.registry


def test_api_key():
    with running_server(make_engine(), api_key="s3cret") as srv:
        url = srv.url("/v1/completions")
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url("/v1/models")).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(srv.url("/health")).status_code == 200  # health stays open
        assert httpx.get(srv.url("/metrics")).status_code == 200
        ok = openai.OpenAI(base_url=srv.url("/v1"), api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
        bad = openai.OpenAI(base_url=srv.url("/v1"), api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_startup_banner_reports_capacity_and_address():
    eng = make_engine(block_size=4, num_kv_blocks=257)
    text = format_startup_banner(eng, host="0.0.0.0", port=8123, model_name=MODEL,
                                 stats=eng.get_stats())
    assert MODEL in text and "http://0.0.0.0:8123/v1" in text
    assert f"{eng.get_stats()['num_total_blocks']} blocks x 4 tokens" in text
    assert eng.config.model.dtype in text

"""`jaxserve bench serve` against a scripted server whose answers are known exactly."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from jaxserve.bench import serving
from jaxserve.bench.traces import TraceRequest
from tests.bench._http import scripted_app, serve_in_thread

LENGTHS = [3, 4, 5, 6, 7, 8, 9, 10, 11]


def _rows():
    return [TraceRequest(f"q{i}", f"prompt {i}", n, 0.0) for i, n in enumerate(LENGTHS)]


def test_failures_are_counted_not_dropped(tmp_path):
    app = scripted_app(fail_every=3)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r.to_json()) + "\n" for r in _rows()))
    out = tmp_path / "r.json"
    with serve_in_thread(app) as url:
        rc = serving.main([f"--base_url={url}", f"--trace={trace}", "--request_rate=inf",
                           "--max_concurrency=1", f"--output_json={out}",
                           "--goodput", "ttft:60000", "tpot:60000"])
    assert rc == 1  # some requests failed
    doc = json.loads(out.read_text())
    s = doc["summary"]
    # One at a time, in trace order: the 3rd, 6th and 9th requests received get HTTP 500.
    failed_ids = {r["id"] for r in doc["requests"] if not r["success"]}
    assert failed_ids == {"q2", "q5", "q8"}
    assert (s["num_requests"], s["completed"], s["failed"]) == (9, 6, 3)
    assert list(s["errors"].values()) == [3] and next(iter(s["errors"])).startswith("HTTP 500")
    ok_lengths = [n for i, n in enumerate(LENGTHS) if i % 3 != 2]
    assert s["total_output_tokens"] == sum(ok_lengths) == 3 + 4 + 6 + 7 + 9 + 10
    assert s["output_tokens_source"] == ["usage"]
    assert s["total_prompt_tokens"] == 7 * 6
    assert s["goodput"]["good_requests"] == 6
    assert s["output_throughput"] == pytest.approx(39 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(s[m]) == {"mean", "median", "p90", "p99"}
        assert all(np.isfinite(v) and v >= 0 for v in s[m].values())
    # Each streamed token after the first gives one ITL sample.
    per = [r for r in doc["requests"] if r["success"]]
    assert sum(len(r["itl"]) for r in per) == sum(n - 1 for n in ok_lengths)
    assert s["e2el_ms"]["median"] >= s["ttft_ms"]["median"]
    bodies = app.state.script["bodies"]
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in bodies)
    assert [b["max_tokens"] for b in bodies] == LENGTHS
    assert bodies[0]["model"] == "scripted"  # from GET /v1/models


def test_chunk_counting_without_usage_and_completions_endpoint():
    app = scripted_app(fail_every=0, usage=False)
    with serve_in_thread(app) as url:
        results, duration, _ = asyncio.run(serving.run_requests(
            _rows(), base_url=url, endpoint="completions", request_rate=200.0, seed=1))
    s = serving.summarize(results, duration)
    assert (s["completed"], s["failed"]) == (9, 0)
    assert s["output_tokens_source"] == ["chunks"]
    assert [r.output_tokens for r in results] == LENGTHS
    assert "prompt" in app.state.script["bodies"][0] and "messages" not in app.state.script["bodies"][0]
    for r in results:  # TPOT = (E2EL - TTFT) / (n - 1)
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / (r.output_tokens - 1))


def test_packed_chunks_undercount_without_usage():
    # A server that packs 4 tokens per chunk and sends no usage: the documented
    # fallback counts chunks, i.e. ceil(n / 4) "tokens".
    app = scripted_app(fail_every=0, usage=False, tokens_per_chunk=4)
    with serve_in_thread(app) as url:
        results, _, _ = asyncio.run(serving.run_requests(_rows(), base_url=url, request_rate=float("inf")))
    assert [r.output_tokens for r in results] == [-(-n // 4) for n in LENGTHS]


def test_unreachable_server_fails_every_request():
    results, duration, model = asyncio.run(serving.run_requests(
        _rows()[:3], base_url="http://127.0.0.1:9/v1", request_rate=float("inf"), timeout_s=5))
    s = serving.summarize(results, duration)
    assert (s["completed"], s["failed"]) == (0, 3) and model == "default"
    assert s["total_output_tokens"] == 0 and np.isnan(s["ttft_ms"]["mean"])


def test_goodput_counts_only_requests_within_slo():
    r_fast = serving.RequestResult("a", 3, success=True, ttft=0.1, e2el=0.3, output_tokens=3)
    r_slow = serving.RequestResult("b", 3, success=True, ttft=2.0, e2el=2.2, output_tokens=3)
    r_fail = serving.RequestResult("c", 3, success=False, error="HTTP 500")
    s = serving.summarize([r_fast, r_slow, r_fail], 2.0, serving.parse_goodput(["ttft:500"]))
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["request_goodput"] == 0.5
    s = serving.summarize([r_fast, r_slow], 2.0, serving.parse_goodput(["tpot:50"]))
    assert s["goodput"]["good_requests"] == 0  # tpot 0.1 s > 50 ms for both
    s = serving.summarize([r_fast, r_slow], 2.0, serving.parse_goodput(["tpot:150", "e2el:1000"]))
    assert s["goodput"]["good_requests"] == 1


@pytest.mark.parametrize("bad", ["ttft", "ttft:abc", "foo:10", "tpot:-1"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError, match="goodput"):
        serving.parse_goodput([bad])


def test_arrival_offsets():
    rows = [TraceRequest(f"x{i}", "p", 1, 0.5 * i) for i in range(4000)]
    assert serving.arrival_offsets(rows, None, 1.0, 0)[:3] == [0.0, 0.5, 1.0]
    assert serving.arrival_offsets(rows, float("inf"), 1.0, 0) == [0.0] * 4000
    for burst in (0.5, 1.0, 4.0):
        t = serving.arrival_offsets(rows, 10.0, burst, 0)
        gaps = np.diff(t)
        assert np.mean(gaps) == pytest.approx(0.1, rel=0.08)
        # Gamma(k, 1/(rate k)) has coefficient of variation 1/sqrt(k).
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(1 / np.sqrt(burst), rel=0.1)
    with pytest.raises(ValueError, match="request_rate"):
        serving.arrival_offsets(rows, 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="burstiness"):
        serving.arrival_offsets(rows, 1.0, 0.0, 0)


def test_against_real_jaxserve_server_with_tiny_model(tmp_path):
    from jaxserve.server import build_app
    from tests.conftest import tiny_engine

    # One compiled program (64 tokens x 4 rows) keeps the test quick.
    engine = tiny_engine(max_num_seqs=4, token_buckets=(64,), seq_buckets=(4,))
    lengths = [3, 5, 2, 6, 4]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"k{i}", "prompt": f"hi {i}", "max_tokens": n,
                                         "arrival_s": 0.01 * i}) + "\n" for i, n in enumerate(lengths)))
    out = tmp_path / "r.json"
    with serve_in_thread(build_app(engine)) as url:
        rc = serving.main([f"--base_url={url}", f"--trace={trace}", f"--output_json={out}",
                           "--goodput", "ttft:60000", "e2el:60000"])
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 5, 0)
    assert len(doc["requests"]) == 5 and doc["config"]["model"] == "tiny"
    # ignore_eos + max_tokens: exactly the requested counts, reported through usage.
    assert [r["output_tokens"] for r in doc["requests"]] == lengths
    assert s["total_output_tokens"] == sum(lengths) and s["output_tokens_source"] == ["usage"]
    assert s["total_prompt_tokens"] > 0
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert all(np.isfinite(s[m][k]) and s[m][k] > 0 for k in ("mean", "median", "p90", "p99"))
    assert s["goodput"]["good_requests"] == 5
    assert s["request_throughput"] == pytest.approx(5 / s["duration_s"])
    assert not engine.has_unfinished_requests()

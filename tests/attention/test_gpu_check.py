"""scripts/gpu_check.py: the CPU dry run passes and writes its JSON; the GPU plan covers the
case mix; its comparison catches bad outputs; its engine goldens are the reference model's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.attention.cases import load_gpu_check

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.fixture(scope="module")
def gpu_check():
    return load_gpu_check()


def test_dry_run_passes_and_writes_json(gpu_check, capsys, tmp_path):
    path = tmp_path / "out.json"
    assert gpu_check.main(["--dry-run", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count(" OK") == 7 and "PASS" in out  # 3 backends x bf16, fp32 + the engine
    report = json.loads(path.read_text())
    assert report["ok"] and report["dry_run"]
    assert {(c["backend"], c["dtype"]) for c in report["checks"]} == {
        (b, d) for b in gpu_check.BACKENDS for d in ("bfloat16", "float32")}
    assert all(c["max_rel_err"] <= c["tol"] for c in report["checks"])
    assert [(r["backend"], r["ok"], r["preemptions"] > 0) for r in report["engine"]] == [
        ("xla", True, True)]
    rows = report["bench"]["results"]
    assert [r["backend"] for r in rows] == list(gpu_check.BACKENDS)
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in rows)


def test_gpu_plan_covers_the_case_mix(gpu_check):
    plan = gpu_check._plan(dry_run=False)
    names = [name for name, _, _ in plan["checks"]]
    for mix in ("decode_only", "prefill_only", "mixed", "chunked", "long_8k"):
        for heads in ("smollm2", "gqa4_d128", "gqa8_d128"):
            assert f"{mix} {heads}" in names
    gqa = {s["num_heads"] // s["num_kv_heads"] for _, s, _ in plan["checks"]}
    assert {4, 8} <= gqa
    assert max(max(s["seq_lens"]) for _, s, _ in plan["checks"]) == 8192
    chunk = plan["bench"]["64x2k+512 chunk gqa4_d128"]
    assert chunk["q_lens"] == [1] * 64 + [512] and set(chunk["seq_lens"]) == {2048}


def test_compare_flags_nan_and_error(gpu_check):
    ref = np.ones((4, 2, 3))
    assert gpu_check.compare("same", ref.copy(), ref, 4, 1e-5)
    bad = ref.copy()
    bad[1, 0, 0] = np.nan
    assert not gpu_check.compare("nan", bad, ref, 4, 1e-5)
    assert gpu_check.compare("nan in padding", bad, ref, 1, 1e-5)
    assert not gpu_check.compare("off", ref + 1e-3, ref, 4, 1e-5)


def test_without_gpu_the_full_check_refuses(gpu_check):
    assert gpu_check.main([]) == 2


def test_engine_goldens_are_the_unpaged_reference_models_greedy_tokens(gpu_check):
    # Independent of the engine: greedy decoding with `reference_logits` (plain causal
    # attention over the whole sequence, no paging, batching or buckets).
    from jaxserve.model.llama import reference_logits

    with open(gpu_check.GOLDEN) as f:
        golden = json.load(f)
    cfg, params = gpu_check.engine_model()
    for prompt, want in zip(gpu_check.engine_prompts(), golden["tokens"]):
        ids = list(prompt)
        for _ in range(gpu_check.ENGINE_MAX_TOKENS):
            arr = np.zeros(64, np.int32)  # one padded shape: one compile
            arr[:len(ids)] = ids
            ids.append(int(np.argmax(reference_logits(cfg, params, arr)[len(ids) - 1])))
        assert ids[len(prompt):] == want
    assert golden["min_logit_margin"] > 0.05 and golden["preemptions"] > 0
    assert [len(p) for p in gpu_check.engine_prompts()] == [13, 19, 6]

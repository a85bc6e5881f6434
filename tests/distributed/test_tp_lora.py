"""LoRA under tensor parallelism (issue 27), run in a child process with 4 fake CPU
devices (`tests/distributed/tp_worker.py lora`): TP = 2 gives TP = 1's tokens and
logprobs for two adapters and a base row in one batch, before and after an
update_lora, with no compile after warm-up; A / B are split like the projection they
attach to; TP > num_key_value_heads is a clear error."""

from __future__ import annotations

from distributed.test_tensor_parallel import assert_same_runs, run_worker

E, F, R, S = 48, 80, 8, 2  # tp_worker's tiny model; max_lora_rank, max_loras


def test_tp2_lora_equals_tp1_and_shards_like_its_projection():
    res = run_worker("lora")
    for phase in range(2):
        assert_same_runs(res["2"]["runs"][phase], res["1"]["runs"][phase])
    assert res["1"]["runs"][0][0]["ids"] != res["1"]["runs"][1][0]["ids"]  # update_lora took
    assert res["1"]["late"] == 0 and res["2"]["late"] == 0
    sh = res["2"]["shards"]
    assert sh["lora_b_wq"] == [[S, R, 64 // 2]] * 2  # column-parallel: B split on out (H*D=64)
    assert sh["lora_a_wq"] == [[E, S, R]] * 2  # ... A replicated
    assert sh["lora_a_w_down"] == [[F // 2, S, R]] * 2  # row-parallel: A split on in
    assert sh["lora_b_w_down"] == [[S, R, E]] * 2
    assert "tensor_parallel_size=4 > num_key_value_heads=2 is not supported" in \
        res["4"]["error"]

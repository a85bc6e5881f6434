"""Shared helpers of the scheduler tests (tiny configs, deterministic tokens)."""

from __future__ import annotations

import zlib

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduler.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.worker.fake_runner import check_invariants, default_token


def make_scheduler(*, budget=32, max_seqs=8, max_model_len=256, block_size=4, num_kv_blocks=64,
                   prefix=True, policy="fcfs", threshold=0, static=False, **kw) -> Scheduler:
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                         max_model_len=max_model_len, long_prefill_token_threshold=threshold,
                         policy=policy, static_batching=static, min_token_bucket=1, **kw)
    cc = CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                     enable_prefix_caching=prefix)
    return Scheduler(sc, cc)


def prompt(n: int, base: int = 0) -> list[int]:
    """n deterministic token ids (>= 10, so they never collide with EOS ids < 10)."""
    return [10 + (base * 131 + i * 7) % 900 for i in range(n)]


def make_req(rid: str, prompt_ids, max_tokens: int | None = 16, *, ignore_eos: bool = True,
             eos=(), priority: int = 0, arrival_time: float | None = None, **sp) -> Request:
    if isinstance(prompt_ids, int):
        prompt_ids = prompt(prompt_ids, base=zlib.crc32(rid.encode()) % 97)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sp)
    return Request(rid, prompt_ids, params, eos_token_ids=eos, priority=priority,
                   arrival_time=arrival_time)


def expected_tokens(rid: str, n: int) -> list[int]:
    """What FakeRunner's default token function emits for rid's first n outputs."""
    return [default_token(rid, i) for i in range(n)]


def assert_pool_clean(s: Scheduler) -> None:
    """Every block is free again (cached blocks nobody holds count as free)."""
    kv = s.kv_cache_manager
    check_invariants(s)
    assert kv.num_free_blocks == kv.num_blocks, (kv.num_free_blocks, kv.num_blocks)
    assert kv.usage == 0.0
    assert not s.has_unfinished_requests() and s.num_running == 0 and s.num_waiting == 0

"""`jaxserve bench host --engine_process`: issue 24's set-up with the engine in its own
process (`jaxserve.engine.core_client.MPEngine`, vLLM V1's EngineCore / frontend split).

The core process builds `jaxserve bench host`'s engine (fake runner, step D) and runs
scheduling, layout, the fake device and the stop rules; this process tokenizes,
detokenizes every token, checks stop strings and builds the `RequestOutput`s. Tokens per
request per second and the step period are counted here, from the outputs (each
request's `num_tokens`); the core's CPU time and its device's busy time are read from it
before and after the window (`MPEngine.call`). The per-phase split of the one-process
bench is not available across processes: `host` here is the period less the time this
process waited for the core's next step, and the phases are this process's CPU time
(`frontend`) and the core process's (`core`, all its threads), per step.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

from jaxserve.bench.host_common import (HostResult, _engine, _row, add_requests, check_texts,
                                        freeze_heap, server_heap)


def _core_engine(rows: int, device_ms: float, tokenizer: Any, stream_interval: int,
                 gc_young: int) -> Any:
    """The bench's engine, built in the core process, its heap frozen as a server's."""
    engine = _engine(rows, device_ms, False, tokenizer, True, stream_interval)
    freeze_heap(gc_young)  # for the core process's life
    return engine


def _core_clock(engine: Any) -> tuple[float, float]:
    """The core's device busy seconds and its process's CPU seconds (all threads)."""
    return engine.runner.device_busy_s, time.process_time()


def run_case_split(rows: int, device_ms: float, *, seconds: float, tokenizer: Any,
                   stream_interval: int = 1, gc_young: int | None = None,
                   log: Callable[[str], None] = print) -> HostResult:
    """`jaxserve.bench.host.run_case` with the engine in its own process (module doc)."""
    from jaxserve.engine.core_client import MPEngine
    from jaxserve.engine.stats import GC_YOUNG_THRESHOLD

    young = GC_YOUNG_THRESHOLD if gc_young is None else gc_young
    eng = MPEngine(functools.partial(_core_engine, rows, device_ms, tokenizer,
                                     stream_interval, young))
    try:
        with server_heap(young):
            return _timed(eng, rows, device_ms, seconds, tokenizer, young, log)
    finally:
        eng.shutdown()


def _timed(eng: Any, rows: int, device_ms: float, seconds: float, tokenizer: Any,
           young: int, log: Callable[[str], None]) -> HostResult:
    from jaxserve.engine.stats import GC_YOUNG_THRESHOLD
    ids, sp = add_requests(eng, rows, tokenizer)
    last: dict[str, Any] = {}  # each request's latest output (read after the window, as
    # the one-process bench reads none: a CUMULATIVE output is a snapshot of its step)

    def made() -> dict[str, int]:
        return {rid: last[rid].outputs[0].num_tokens if rid in last else 0 for rid in ids}
    while not all(made().values()):
        for o in eng.step():  # the prefills
            last[o.request_id] = o
    n0 = made()
    busy0, cpu0 = eng.call(_core_clock)
    left = min(sp.max_tokens - n for n in n0.values())
    steps, waited, t0, fcpu0 = 0, 0.0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds and steps < left - 3:  # the core runs ahead
        for o in eng.step():
            last[o.request_id] = o
        waited += eng.last_wait_s
        steps += 1
    wall, fcpu = time.perf_counter() - t0, time.thread_time() - fcpu0
    busy1, cpu1 = eng.call(_core_clock)
    if steps >= left - 3:
        log(f"  window {wall:.2f} s, not {seconds:g} s: ended {steps} steps in, before the "
            f"{left} tokens the requests had left")
    ended = [o.request_id for o in last.values() if o.finished]
    if ended:
        raise RuntimeError(f"requests finished inside the timed window: {ended[:4]}")
    n1 = made()
    check_texts(last, tokenizer)
    shown = sum(len(last[r].outputs[0].text) for r in ids)
    gained = [n1[r] - n0[r] for r in ids]
    period = wall / steps
    device = busy1 - busy0
    res = HostResult(
        runner="fake,engine_process" + ("" if young == GC_YOUNG_THRESHOLD else f",gc={young}"),
        rows=rows, device_ms=device_ms, steps=steps, seconds=round(wall, 3),
        tokens_per_request_per_s=round(sum(gained) / len(gained) / wall, 1),
        period_ms=round(period * 1e3, 3), device_ms_per_step=round(device / steps * 1e3, 3),
        host_ms_per_step=round((wall - waited) / steps * 1e3, 3),
        host_us_per_row=round((wall - waited) / steps / rows * 1e6, 1),
        device_idle=round(max(0.0, 1 - device / wall), 3),
        phases_ms_per_step={"frontend": round(fcpu / steps * 1e3, 3),
                            "core": round((cpu1 - cpu0) / steps * 1e3, 3)},
        cpu_ms_per_step=round(fcpu / steps * 1e3, 3))
    log(_row(res) + f"  text={shown / rows:.0f} chars/request")
    return res


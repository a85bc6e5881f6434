"""`jaxserve bench host`: how much host time the engine spends around each device step.

    jaxserve bench host                                  # 16/64/256 running, D = 1 and 2 ms
    jaxserve bench host --rows=64 --device_ms=1 --seconds=5
    jaxserve bench host --real --rows=16,64              # the real ModelRunner, tiny model
    jaxserve bench host --engine_process                 # MPEngine: the core in a process

The set-up is issue 24's: `make_engine_config(ModelConfig.smollm2_135m(),
max_num_seqs=N, max_num_batched_tokens=max(2048, N), num_kv_blocks=128*N+1,
block_size=16, max_model_len=2048)`, an `LLMEngine` over
`FakeRunner.for_config(cfg, build_batches=True, step_delay=D/1000)` whose simulated
device is a FIFO queue (step k starts at max(its dispatch, the end of step k-1) and
ends D later; fetching waits, using no CPU), SmolLM2's real tokenizer detokenizing
every token, N requests of one chat prompt with `max_tokens=1900`, greedy,
`ignore_eos`. Once all N are decoding, the engine is timed over `--seconds` (ended
early, and said, after one step fewer than the tokens the requests have left).

Per case it prints: tokens per request per second (the goal is 1000 / D), the step
period, host time per step and per row (the step period minus the time `step()` was
blocked on the device: its busy time plus any late wake-up of the fake's sleep), the
device's busy time per step, its idle fraction, the engine thread's CPU time per step
(`time.thread_time`: host work alone, less inflated than wall time when other processes
take the cores), and a per-phase breakdown of the host time:
schedule, runner host work (batch layout, the fake's bookkeeping; with `--real`
also attention and sampling metadata), update_from_output, output processing
(incremental detokenizer, stop checks, `RequestOutput` assembly) and the rest of
`step()`. With `--real` the device half is `ModelRunner.launch_host_batch` (host to
device copy, the programs' launch) and `tp.fetch` (waiting for them, the copy back),
timed as they run. `--stream_interval=k` gives each request an output every k tokens
(vLLM's; the default 1 is every token). `--no_async` turns the engine's `async_scheduling` off (the serial
loop: plan, run, fetch, process outputs, then plan the next). `--placeholders=off` keeps
async scheduling but plans step n+1 only once step n's tokens are back (the loop before
output placeholders; with `--real`, `on` forces them on although the engine's default on
CPU is off, `EngineConfig.async_placeholders`); `ab` runs each case on, off, on, off in
one process (the machine's drift hits both alike). `--gc_young` sets the cyclic GC's
young-generation threshold for the A/B (default: the one `jaxserve serve` runs with after
its warm-up, `jaxserve.engine.stats.GC_YOUNG_THRESHOLD`; CPython's own is 700).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from jaxserve.bench.host_common import (HostResult, _engine, _row, add_requests, check_texts,
                                        server_heap)

PHASES = ("schedule", "runner_host", "update", "output", "other")


@dataclass
class PhaseClock:
    """Seconds spent in each wrapped call (wall time, `time.perf_counter`)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    device: float = 0.0
    launch: float = 0.0  # the part of `device` spent inside the runner's dispatch
    h2d_bytes: int = 0  # host-to-device bytes of the steps timed (the real runner)

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """Replace `obj.name` by a wrapper that adds its wall time to `phase` ("device":
        to `device`)."""
        fn = getattr(obj, name)

        def add(dt: float) -> None:
            if phase in ("device", "launch"):
                self.device += dt
                if phase == "launch":
                    self.launch += dt
            else:
                self.seconds[phase] += dt

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                add(time.perf_counter() - t0)
        setattr(obj, name, timed)

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0
        self.device = self.launch = 0.0
        self.h2d_bytes = 0


def _instrument(engine: Any, clock: PhaseClock) -> None:
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update_from_output", "update")
    for name in ("process_tokens", "collect", "process_prompt_logprobs"):
        clock.wrap(engine.outputs, name, "output")
    runner = engine.runner
    if hasattr(runner, "launch_host_batch"):  # the real runner: time its device half
        launch = runner.launch_host_batch

        def counted(host, *a, **kw):  # the bytes of the host arrays the step copies (a
            import jax  # shared constant stays on the device: `constant_array`)
            import numpy as np

            from jaxserve.sample.metadata import is_constant_array
            clock.h2d_bytes += sum(x.nbytes for x in jax.tree.leaves(host)
                                   if isinstance(x, np.ndarray) and not is_constant_array(x))
            return launch(host, *a, **kw)
        runner.launch_host_batch = counted
        clock.wrap(runner, "launch_host_batch", "launch")
        clock.wrap(runner.tp, "fetch", "device")
    clock.wrap(runner, "dispatch", "runner_host")
    clock.wrap(runner, "execute", "runner_host")  # plans with no rows


def run_case(rows: int, device_ms: float, *, seconds: float, real: bool, tokenizer: Any,
             async_scheduling: bool = True, stream_interval: int = 1,
             placeholders: bool = True, gc_young: int | None = None,
             log: Callable[[str], None] = print) -> HostResult:
    """Time one case (see the module doc); all `rows` requests decode throughout.
    `placeholders=False`: the runner refuses plans made ahead (`placeholders_ok`).
    `gc_young`: the cyclic GC's young-generation threshold during the case (None: the
    server's, `jaxserve.engine.stats.GC_YOUNG_THRESHOLD`; 700 is CPython's default)."""
    from jaxserve.engine.stats import GC_YOUNG_THRESHOLD

    engine = _engine(rows, device_ms, real, tokenizer, async_scheduling, stream_interval)
    engine.runner.placeholders = placeholders  # the real runner's default on CPU is off
    with server_heap(GC_YOUNG_THRESHOLD if gc_young is None else gc_young):
        return _timed_case(engine, rows, device_ms, seconds, real, async_scheduling,
                           stream_interval, placeholders, tokenizer, log)


def _timed_case(engine: Any, rows: int, device_ms: float, seconds: float, real: bool,
                async_scheduling: bool, stream_interval: int, placeholders: bool,
                tokenizer: Any, log: Callable[[str], None]) -> HostResult:
    from jaxserve.engine.stats import GC_YOUNG_THRESHOLD
    ids, sp = add_requests(engine, rows, tokenizer)
    def decoding() -> bool:
        live = [engine.scheduler.get_request(r) for r in ids]
        if any(r is None for r in live):
            raise RuntimeError("a request ended during its prefill (see the engine's log)")
        return all(r.num_output_tokens for r in live)
    while not decoding():
        engine.step()  # the prefills
    clock = PhaseClock()
    _instrument(engine, clock)
    runner = engine.runner
    busy0 = getattr(runner, "device_busy_s", 0.0)
    wait0 = getattr(runner, "device_wait_s", 0.0)
    n0 = {r: engine.scheduler.get_request(r).num_output_tokens for r in ids}
    steps, t0, cpu0 = 0, time.perf_counter(), time.thread_time()
    # The window ends before the requests do (max_tokens=1900: 1.9 s at D = 1 ms once the
    # period reaches D): at most one step fewer than the tokens they have left.
    left = min(sp.max_tokens - n for n in n0.values())
    last: dict[str, Any] = {}  # each request's latest output, its text checked after
    while time.perf_counter() - t0 < seconds and steps < left - 1:
        for o in engine.step():
            last[o.request_id] = o
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if steps >= left - 1:
        log(f"  window {wall:.2f} s, not {seconds:g} s: ended after {steps} steps, one fewer "
            f"than the {left} tokens the requests had left")
    live = [engine.scheduler.get_request(r) for r in ids]
    if any(r is None for r in live):
        raise RuntimeError("a request finished inside the timed window (the window ends before "
                           "its tokens run out: see the engine's log)")
    gained = [r.num_output_tokens - n0[r.request_id] for r in live]
    check_texts(last, tokenizer)
    # device: its busy time; wait: the engine's time blocked on it (the fake's sleep can
    # overrun D when the OS wakes it late: that is waiting, not host work).
    device = clock.device if real else runner.device_busy_s - busy0
    wait = clock.device if real else runner.device_wait_s - wait0
    phases = dict(clock.seconds)
    phases["runner_host"] -= clock.launch  # the real runner launches inside dispatch
    phases["other"] = max(0.0, wall - wait - sum(phases.values()))
    for rid in ids:
        engine.abort(rid)
    engine.step()
    period = wall / steps
    host = period - wait / steps
    res = HostResult(
        runner=("model_runner(tiny)" if real else "fake") + ("" if async_scheduling else ",serial")
        + ("" if placeholders or not async_scheduling else ",no_ph")
        + ("" if stream_interval == 1 else f",k={stream_interval}")
        + ("" if gc.get_threshold()[0] == GC_YOUNG_THRESHOLD else f",gc={gc.get_threshold()[0]}"),
        rows=rows,
        device_ms=None if real else device_ms, steps=steps, seconds=round(wall, 3),
        tokens_per_request_per_s=round(sum(gained) / len(gained) / wall, 1),
        period_ms=round(period * 1e3, 3), device_ms_per_step=round(device / steps * 1e3, 3),
        host_ms_per_step=round(host * 1e3, 3), host_us_per_row=round(host / rows * 1e6, 1),
        device_idle=round(1 - device / wall, 3),
        phases_ms_per_step={k: round(v / steps * 1e3, 3) for k, v in phases.items()},
        h2d_kib_per_step=round(clock.h2d_bytes / steps / 1024, 1) if real else None,
        cpu_ms_per_step=round(cpu / steps * 1e3, 3))
    log(_row(res))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run every (rows, device_ms) case, print one line each; returns 0."""
    ap = argparse.ArgumentParser(prog="jaxserve bench host", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,64,256", help="running requests, comma-separated")
    ap.add_argument("--device_ms", default="1,2", help="simulated device step D in ms")
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window per case")
    ap.add_argument("--real", action="store_true",
                    help="the real ModelRunner on the tiny model instead of the fake")
    ap.add_argument("--model", default=None, help="GGUF whose tokenizer detokenizes "
                    "(default: the default SmolLM2 file)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--stream_interval", type=int, default=1,
                    help="the engine's stream_interval (vLLM's): tokens per output")
    ap.add_argument("--no_async", action="store_true",
                    help="async_scheduling off: the serial loop, for an A/B")
    ap.add_argument("--gc_young", type=int, default=None,
                    help="the cyclic GC's young threshold (default: the server's, "
                    "jaxserve.engine.stats.GC_YOUNG_THRESHOLD; 700: CPython's)")
    ap.add_argument("--placeholders", choices=("on", "off", "ab"), default="on",
                    help="plan step n+1 before step n's tokens are back (on), only after "
                    "(off), or each case on, off, on, off (ab)")
    ap.add_argument("--engine_process", action="store_true",
                    help="the engine in its own process, outputs assembled in this one "
                    "(MPEngine, vLLM V1's split; the fake runner only)")
    a = ap.parse_args(argv)
    if a.engine_process and (a.real or a.no_async or a.placeholders != "on"):
        ap.error("--engine_process runs the fake with its defaults: no --real, --no_async "
                 "or --placeholders")
    from jaxserve.checkpoint.loader import load_tokenizer

    tok = load_tokenizer(a.model)
    rows = [int(x) for x in a.rows.split(",") if x]
    dms = [None] if a.real else [float(x) for x in a.device_ms.split(",") if x]
    import os
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    ph = {"on": (True,), "off": (False,), "ab": (True, False, True, False)}[a.placeholders]
    if a.engine_process:
        from jaxserve.bench.host_split import run_case_split

        results = [asdict(run_case_split(n, d, seconds=a.seconds, tokenizer=tok,
                                         stream_interval=a.stream_interval,
                                         gc_young=a.gc_young,
                                         log=lambda s: print(s, flush=True)))
                   for d in dms for n in rows]
    else:
        results = [asdict(run_case(n, d or 0.0, seconds=a.seconds, real=a.real, tokenizer=tok,
                                   async_scheduling=not a.no_async,
                                   stream_interval=a.stream_interval, placeholders=p,
                                   gc_young=a.gc_young, log=lambda s: print(s, flush=True)))
                   for d in dms for n in rows for p in ph]
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0

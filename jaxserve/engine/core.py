"""LLMEngine: add_request / step / abort over an input processor, the scheduler, a
runner and an output processor.

One `step()` is one iteration of continuous batching (Orca, OSDI'22; vLLM V1's
EngineCore): the scheduler plans, the runner executes the plan (one bucketed program on
the device, or a fake), the scheduler applies the sampled tokens and stop rules, and the
output processor turns tokens into text, logprobs and `RequestOutput`s. As in vLLM V1,
prompts become requests in `jaxserve.engine.input_processor`, outputs are assembled in
`jaxserve.engine.output_processor`, and the runner sits behind the `Runner` protocol
(`jaxserve.worker.runner`), so tests plug in `FakeRunner`. LoRA: `jaxserve.engine.lora`.

Structured output (`jaxserve.structured_output`): a request with `structured_outputs`
(or a LoRA request waiting for a slot) is held here, out of the scheduler, until its
grammar is compiled (a thread pool, cached by spec) and its adapter has a slot; the batch
never waits for a compile. The runner fills each grammar row's bitmask; the output
processor advances the matcher by each token. Not thread-safe: use one thread.

Async scheduling (vLLM's, issue 24; `EngineConfig.async_scheduling`): `step()` dispatches
the next step (`Runner.dispatch`) before it processes the outputs of the one it fetched.
Where the runner can take them (`Runner.placeholders_ok`), the next step is planned and
dispatched before this one's tokens are even back, with output placeholders (vLLM V1's
`num_output_placeholders`): each decode row reads its input token from the step before
on the device, and the host's planning and layout run while the device computes. After a
step with structured-output rows, while the runner holds a penalised or scoring request,
multi-host, and by default on CPU (`EngineConfig.async_placeholders`), the next step is
planned only once this one's tokens are back (README "Policies worth knowing").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.args import _eos_token_ids
from jaxserve.engine.control import EngineControl
from jaxserve.engine.input_processor import InputProcessor, ProcessedRequest
from jaxserve.engine.lora import EngineLoRA
from jaxserve.engine.output_processor import FinishRequests, OutputProcessor
from jaxserve.engine.stats import engine_stats, freeze_gc_heap
from jaxserve.engine.pause import Pauser, check_mode
from jaxserve.engine.sleep import Sleeper
from jaxserve.outputs import RequestOutput
from jaxserve.scheduler.request import RequestStatus
from jaxserve.worker.runner import (DoneStep, PendingStep, RowError, Runner,
                                    SampledToken)
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.buckets import BucketPolicy
from jaxserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine(EngineControl):
    """The engine: continuous batching over a paged KV cache with bucketed steps.

    Args:
      config: the engine config; `cache.num_kv_blocks=None` sizes the pool from
        `cache.kv_cache_memory_bytes` (the runner resolves it).
      params: the model parameter tree (`jaxserve.model.llama` layout); used
        only to build the default `ModelRunner` (None with `runner=`).
      tokenizer: a `jaxserve.checkpoint.tokenizer.Tokenizer`-like object, or
        None for token-id-only use (no text, no stop strings).
      runner: what executes the steps (the `Runner` protocol); default a
        `jaxserve.worker.model_runner.ModelRunner` over `params`.
      warmup: make every bucket program ready now (recommended; a serving
        engine must not compile after warm-up).
      executable_cache_dir: where the default runner serializes its compiled programs
        (`jaxserve.worker.executable_cache`; None: off).
      freeze_gc: after warm-up, freeze the startup heap out of the cyclic GC's reach, once
        per process (`jaxserve.engine.stats.freeze_gc_heap`, as vLLM does after warm-up in
        its engine process). Off by default: frozen cyclic garbage is never collected, so
        a process that builds and drops engines would keep the first one's memory;
        `jaxserve serve` / `generate` freeze after their own warm-up. The same call
        raises the process's young-generation GC threshold to 50 000 for good
        (`jaxserve.engine.stats.tune_gc`).

    Raises:
      ValueError: neither params nor a runner, or bad EOS ids.
    """

    def __init__(self, config: EngineConfig, params: Any = None, tokenizer: Any = None, *,
                 runner: Runner | None = None, model_name: str = "jaxserve", warmup: bool = True,
                 progress: bool = True, executable_cache_dir: str | None = None,
                 freeze_gc: bool = False):
        self.bucket_policy = BucketPolicy.from_config(config.scheduler)
        if runner is None:
            if params is None:
                raise ValueError("LLMEngine needs the model params or a runner")
            from jaxserve.worker.model_runner import ModelRunner  # jax, only for the real runner

            runner = ModelRunner(config, params, bucket_policy=self.bucket_policy,
                                 executable_cache_dir=executable_cache_dir)
        self.runner: Runner = runner
        self.config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_kv_blocks=runner.num_kv_blocks))
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache,
                                   bucket_policy=self.bucket_policy)
        self.eos_token_ids = _eos_token_ids(self.config, tokenizer)
        self.inputs = InputProcessor(self.config, tokenizer, self.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, stream_interval=self.config.stream_interval)
        self.prompt_tokens_total = 0
        self.last_step_tokens = 0
        self.num_aborted = 0
        self.num_failed_steps = 0
        self._pending: list[RequestOutput] = []  # outputs of requests update_params failed
        self.async_scheduling = self.config.async_scheduling  # may be flipped between steps
        # (plan, PendingStep) of the step dispatched and not yet fetched (async scheduling)
        self._inflight: tuple[Any, PendingStep] | None = None
        self._ahead_raised = False  # planning ahead raised: apply the step in flight alone
        self.pauser = Pauser(self.scheduler, self.outputs,
                             lambda: self._step(overlap=False))  # issue 28
        self.sleeper = Sleeper(self.scheduler, self.pauser, self.runner)  # issue 28: sleep
        self.lora = EngineLoRA(self)  # issue 27: adapters, slots, update_lora
        self.grammars = None  # structured_output.GrammarCompiler (llguidance), with a tokenizer
        if tokenizer is not None:
            from jaxserve.structured_output import GrammarCompiler

            self.grammars = GrammarCompiler(tokenizer, self.config.model.vocab_size,
                                            self.eos_token_ids)
        # request_id -> (request, its grammar's future): held until the grammar is compiled
        self._awaiting_grammar: dict[str, tuple[ProcessedRequest, concurrent.futures.Future]] = {}
        if warmup:
            self.runner.warmup(progress=progress)
            if freeze_gc:
                freeze_gc_heap()

    # -------------------------------------------------------------- input
    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, *,
                    messages: Sequence[dict[str, Any]] | None = None, priority: int = 0,
                    arrival_time: float | None = None, logprob_start: int | None = None,
                    lora_request: Any = None) -> list[int]:
        """Queue a request; return its prompt token ids.

        A request with `structured_outputs` whose grammar is still compiling is held
        by the engine (not the scheduler) and queued by the first `step()` after it
        is ready; a compile that fails then ends it with finish_reason "error".

        `logprob_start` j (scoring, `LLM.score`): report the teacher-forced logprobs
        of prompt tokens j.. (`RequestOutput.prompt_token_logprobs`), as
        `SamplingParams.prompt_logprobs` does from j = 1.

        Raises:
          ValueError: duplicate id, a bad sampling parameter, empty prompt, a
            token id outside the vocabulary, a prompt with no room for one
            output token under max_model_len, or a request the KV pool can
            never hold. Raised before anything is queued, so a rejected
            request leaks nothing.
          EngineSleepingError: asleep with reject_new=True (see `sleep`).
        """
        self.sleeper.check_admit(request_id)
        p = self.inputs.process(request_id, prompt, params, messages=messages, priority=priority,
                                arrival_time=arrival_time, live_ids=self.outputs.live_ids(),
                                logprob_start=logprob_start)
        self.add_processed(p, lora_request)
        return p.prompt_token_ids

    def add_processed(self, p: ProcessedRequest, lora_request: Any = None) -> None:
        """`add_request` from its `InputProcessor` result on (the engine-core process gets
        requests processed by its frontend, `jaxserve.engine.core_client`). Raises as
        `add_request` for its adapter and grammar; nothing is queued then."""
        rid = p.request_id
        if self._inflight is not None and any(  # an aborted id reused: its old row first
                r == rid or r.startswith(rid + "#")
                for r in (sr.request_id for sr in self._inflight[0].scheduled)):
            self._pending += self._step(overlap=False)
        has_slot = self.lora.attach(p.children, lora_request)  # its adapter's slot, or wait
        so, fut = p.children[0].sampling_params.structured_outputs, None
        if so is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs needs a tokenizer, and this engine was "
                                 "built without one")
            fut = self.grammars.submit(so.spec)
        if not has_slot or (fut is not None and not fut.done()):  # held: `_admit_compiled`
            self.outputs.add(p)  # queues it once compiled and its adapter has a slot
            self._awaiting_grammar[p.request_id] = (p, fut)
            self.prompt_tokens_total += len(p.prompt_token_ids)
            return
        self._attach_grammar(p, fut)  # a failed compile raises here: nothing queued
        self._queue(p)

    def _attach_grammar(self, p: ProcessedRequest, fut: concurrent.futures.Future | None) -> None:
        compiled = fut.result() if fut else None  # ValidationError / GrammarDeadEnd of it
        for req in p.children if compiled else ():
            req.grammar = compiled.new_matcher()

    def _queue(self, p: ProcessedRequest, *, tracked: bool = False) -> None:
        """Hand a processed request to the scheduler (and the output processor unless
        `tracked`); all children or none."""
        added: list[str] = []
        try:
            for req in p.children:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except Exception:
            for cid in added:
                self.scheduler.abort(cid)
            raise
        if not tracked:
            self.outputs.add(p)
            self.prompt_tokens_total += len(p.prompt_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue held requests whose grammar is ready and adapter has its slot; fail those
        whose compile, slot or admission failed. Waits 5 ms for a compile only when idle."""
        held = self._awaiting_grammar
        if not self.scheduler.has_unfinished_requests():
            concurrent.futures.wait([f for _, f in held.values() if f is not None],
                                    timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)
        ready = self.lora.admit_held()  # rid -> None or its slot write's error (lora.py)
        failed: list[str] = []
        for rid, (p, fut) in list(held.items()):
            if rid not in ready or (fut is not None and not fut.done()):
                continue
            del held[rid]
            try:
                if ready[rid] is not None:
                    raise ready[rid]
                self._attach_grammar(p, fut)
                self._queue(p, tracked=True)
            except Exception as e:  # never seen by the scheduler, so the engine ends it
                for req in p.children:
                    req.status = RequestStatus.FINISHED_ERROR
                failed += self.outputs.fail([c.request_id for c in p.children], (
                    "structured output: " if fut else "LoRA: ") + f"{type(e).__name__}: {e}")
        return self.outputs.collect(failed)

    # -------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration; return outputs of requests that progressed.

        A row whose own host work fails ends alone with finish_reason "error".
        A failure of the whole step preempts its rows by recompute and retries
        them once (`Scheduler.fail_step`); a row that fails a second time ends
        with "error". When the runner had to rebuild the KV cache, every other
        running request is recomputed too. The engine itself stays usable.
        """
        pending, self._pending = self._pending, []
        if self._awaiting_grammar:
            pending += self._admit_compiled()
        if self._inflight is None and (self.pauser.paused or self.sleeper.is_sleeping):
            return pending  # nothing is scheduled until resume / wake_up
        return pending + self._step()

    def _step(self, overlap: bool | None = None) -> list[RequestOutput]:
        """One iteration: plan and dispatch a step unless one is in flight, fetch its
        tokens, apply them; with overlap (`async_scheduling`), plan and dispatch the next
        step before this one's fetch (placeholders, `_can_plan_ahead`) or else before its
        output processing, so the device runs it meanwhile."""
        outs: list[RequestOutput] = []
        self.last_step_tokens = 0  # the tokens of the step whose results this call applies
        if self._inflight is None and not self._dispatch(outs):
            return outs
        (out, handle), self._inflight = self._inflight, None
        if overlap is None:  # after planning ahead raised, the step in flight is applied
            overlap = self.async_scheduling and not self._ahead_raised  # first, serially
        self._ahead_raised = False
        # Step n+1 planned and dispatched now, its decode rows reading step n's tokens on
        # the device. If its dispatch fails, the plan is taken back once step n is applied
        # and planned again the usual way (a failure of its own then counts).
        ahead_failed = None  # (plan, error) of a plan made ahead whose dispatch raised
        if overlap and self._can_plan_ahead(out):
            try:
                planned, err = self._launch(ahead=True)
            except BaseException:  # planning raised: step n stays in flight, applied next
                self._inflight, self._ahead_raised = (out, handle), True  # call, serially
                raise
            ahead_failed = None if err is None else (planned, err)
        self.last_step_tokens = out.num_scheduled_tokens
        try:
            results = handle.result()
        except Exception as e:  # one bad step fails its requests, never the engine
            self._drop_ahead(ahead_failed)  # it read this step's tokens
            return outs + self._fail_step(out, e)
        changed: list[str] = []
        # One pass over the rows. Rows whose request ended while the step ran (a stop
        # string found in the step before's output processing, an abort) are dropped:
        # the scheduler skips them too.
        reqs = self.scheduler.requests
        errors, sampled, tokens, scored = {}, {}, {}, {}
        for rid, r in results.items():
            if type(r) is SampledToken:  # (no subclasses: cheaper than isinstance)
                if rid in reqs:
                    sampled[rid], tokens[rid] = r, r.token_id
                    if r.prompt is not None:
                        scored[rid] = r.prompt
            elif isinstance(r, RowError):
                errors[rid] = r
            elif rid in reqs:  # PromptLogprobs of a scoring row that does not sample
                scored[rid] = r
        for rid, err in errors.items():
            if rid not in reqs:  # ended since (a row planned ahead of its EOS, an abort)
                continue
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR)
            changed += self.outputs.fail([rid], err.message)
        if scored:
            self.outputs.process_prompt_logprobs(scored)
        self.scheduler.update_from_output(out, tokens)
        if ahead_failed is not None:
            logger.warning("dispatching the step planned ahead failed (%s: %s); planning it "
                           "again", type(ahead_failed[1]).__name__, ahead_failed[1])
            self.scheduler.unschedule(ahead_failed[0])
        grammar = self.grammars is not None and self.grammars.num_compiled
        # A row that sampled under a grammar must accept its token before its next mask:
        # after such a step the next is planned only once the matchers have advanced.
        if (overlap and self._inflight is None and out.grammar is None
                and not self.pauser.paused and not self.sleeper.is_sleeping):
            self._dispatch(outs)  # step n+1 runs while step n's outputs are processed
        progressed, fin = self.outputs.process_tokens(sampled, time.monotonic())
        self._apply(fin)
        changed += progressed
        if grammar:
            progressed, fin = self.outputs.advance_grammars(sampled)
            self._apply(fin)
            changed += progressed
        return outs + self.outputs.collect(changed)

    def _can_plan_ahead(self, out: Any) -> bool:
        """Whether the step after `out` may be planned before `out`'s tokens are back: no
        grammar row in `out` (its matcher must accept the token first), not pausing or
        asleep, and a runner that can feed placeholders (no penalised or scoring rows)."""
        if out.grammar is not None or self.pauser.paused or self.sleeper.is_sleeping:
            return False
        ok = getattr(self.runner, "placeholders_ok", None)
        return ok is not None and ok()

    def _dispatch(self, outs: list[RequestOutput]) -> bool:
        """Plan a step and dispatch it (`_launch`); False when nothing was dispatched. A
        step that fails to dispatch fails its requests, their outputs appended to `outs`."""
        out, err = self._launch()
        if err is not None:
            outs += self._fail_step(out, err)
        return out is not None and err is None

    def _launch(self, *, ahead: bool = False) -> tuple[Any, Exception | None]:
        """Plan a step (`ahead`: before the step in flight's tokens are back,
        `Scheduler.schedule(ahead=True)`) and dispatch it to the runner (`self._inflight`).
        Returns (plan, None) once dispatched; (None, None) for a plan with no rows (then it
        only tells the runner what ended); (plan, error) when its dispatch raised."""
        # Ahead, the step in flight's blocks are registered once this plan is dispatched.
        try:
            out = self.scheduler.schedule(self.runner.token_cap, ahead=ahead,
                                          defer_commits=ahead)
            try:  # a plan that fails here fails as a step (ahead: taken back, `_step`)
                self.outputs.on_scheduled(out, time.monotonic())
                if not out.scheduled:  # the runner's still: it drops the finished, preempted
                    self.runner.execute(out)
                    return None, None
                dispatch = getattr(self.runner, "dispatch", None)
                handle = (dispatch(out) if dispatch is not None
                          else DoneStep(self.runner.execute(out)))
            except Exception as e:
                if not out.scheduled:
                    raise
                return out, e
            self._inflight = (out, handle)
            return out, None
        finally:  # however planning or dispatch ended; a dispatched step is never lost
            try:
                self.scheduler.commit_deferred()
            except Exception:  # a lost registration costs hits, never a step's tokens
                logger.exception("registering the step in flight's blocks failed")

    def _drop_ahead(self, failed: tuple[Any, Exception] | None) -> None:
        """The step before the one planned ahead failed: the one in flight read its tokens,
        so it is waited for, its tokens dropped and its plan taken back (as is the plan
        whose dispatch `failed`, if that is what happened to it)."""
        if failed is not None:
            self.scheduler.unschedule(failed[0])
        if self._inflight is not None:
            (out, handle), self._inflight = self._inflight, None
            try:
                handle.result()
            except Exception:  # its own failure changes nothing: it is taken back anyway
                logger.debug("the step planned ahead of a failed step failed too", exc_info=True)
            self.scheduler.unschedule(out)

    def _fail_step(self, out: Any, e: Exception) -> list[RequestOutput]:
        logger.error("engine step failed", exc_info=e)
        self.num_failed_steps += 1
        try:
            kv_lost = self.runner.reset()
        except Exception:  # e.g. no memory for a new cache: assume every KV row is gone
            logger.exception("runner reset failed")
            kv_lost = True
        ids = self.scheduler.fail_step(out, kv_lost=kv_lost)
        return self.outputs.collect(self.outputs.fail(ids, f"{type(e).__name__}: {e}"))

    def _drain(self) -> None:
        """Drop the step in flight, if any (before a pause, a sleep or a weight swap): it
        was dispatched ahead of the `step()` that returns its tokens, so the requests
        stand where serial steps would have left them; the scheduler takes the plan
        back and its rows rerun."""
        if self._inflight is not None:
            (out, handle), self._inflight = self._inflight, None
            try:
                handle.result()  # the device finishes it; its tokens are not kept
            except Exception as e:
                self._pending += self._fail_step(out, e)
                return
            self.scheduler.unschedule(out)

    def _apply(self, fin: FinishRequests) -> None:
        """Finish what the output processor found finished, through the scheduler."""
        for req in fin.by_stop_string:
            self.scheduler.stop_by_string(req)
        for rid, status in fin.finished:
            self.scheduler.finish_requests([rid], status)

    # -------------------------------------------------------------- weights
    def update_params(self, params: Any, in_flight: str = "abort") -> int:
        """Swap the model weights between steps; return the new `weight_version`.

        `params` is a `Llama` NNX module, its `nnx.State` or a canonical tree
        (NumPy or jax), as `LLMEngine(config, params)` takes. The runner checks
        and converts it through the one `prepare_params` and keeps its compiled
        programs (no recompilation). Requests in flight are FAILED (finish_reason
        "error", the message names both weight versions), never continued on
        new weights over KV computed with the old ones; their final outputs
        come back from the next `step()`. The prefix cache is forgotten, since
        its KV belongs to the old weights. (vLLM's RL weight sync and SGLang's
        update_weights_from_disk pause or drain the same way.)

        Raises:
          ValueError: a missing, extra, mis-shaped or wrongly typed leaf, naming
            its path; the engine then keeps serving the old weights untouched.
          TypeError: the runner cannot swap weights (e.g. a FakeRunner).

        `in_flight` (issue 28) is the pause mode used around the swap (see
        `pause_generation`); "abort" is the behaviour above. When the engine is
        already paused, the swap happens inside that pause and `in_flight` is unused.
        """
        check_mode(in_flight)
        self._drain()
        swap = getattr(self.runner, "update_params", None)
        if swap is None:
            raise TypeError(f"{type(self.runner).__name__} has no update_params")
        own = not self.pauser.paused
        if own and in_flight == "wait":  # drain on the old weights, then swap
            self.pause_generation("wait")
            try:
                swap(params)
            except Exception:
                self.resume_generation()
                raise
        else:  # no step runs in between, so validating first changes nothing
            swap(params)  # a bad tree raises here, before anything changes
            if own:
                self.pause_generation(in_flight, _new_version=self.weight_version + 1)
        self.weight_version += 1
        if own:
            self.resume_generation()
        self.scheduler.reset_prefix_cache(stale_held=True)  # kept requests' KV is old
        return self.weight_version

    # -------------------------------------------------------------- control
    def abort(self, request_id: str) -> bool:
        """Abort a user request in any state; frees its KV blocks. False if unknown."""
        children = self.outputs.pop(request_id)
        if children is None:
            return False
        self._awaiting_grammar.pop(request_id, None)  # held for its grammar: never queued
        for req in children:
            self.scheduler.abort(req.request_id)
        self.num_aborted += 1
        return True

    def abort_older_than(self, version: int) -> list[str]:
        """Abort the requests that started under a weight version older than
        `version` (issue 28; SGLang has a draft of the same); return their ids.
        Requests started at `version` or later go on untouched."""
        ids = self.outputs.older_than(version)
        for rid in ids:
            self.abort(rid)
        return ids

    @property
    def weight_version(self) -> int:
        """+1 per successful `update_params` (issue 28): each completion's
        `token_weight_versions` holds it per token (kept by the output processor)."""
        return self.outputs.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.outputs.weight_version = version

    def has_unfinished_requests(self) -> bool:
        """True while a request is live or a finished one's output awaits `step()`."""
        return self.outputs.num_live > 0 or bool(self._pending)  # a step in flight has live rows

    def get_stats(self) -> dict[str, Any]:
        """Counters and gauges for metrics endpoints and benchmark summaries."""
        return engine_stats(self)


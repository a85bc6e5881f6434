"""The engine's LoRA side (issue 27): registered adapters, each request's slot, and
`update_lora`, the RL step's adapter-only weight sync.

A request on an adapter takes the adapter's device slot when it is added
(`jaxserve.lora.manager.LoRASlots.acquire`: LRU over the slots no live request uses)
and keeps it until it ends, so an adapter in use is never evicted; the slot reaches
the runner in the plan's `NewRequestData.lora_slot`. When every slot holds an adapter
of a live request (queued, or held by the engine for its grammar compile), the request
waits, held by the engine beside the grammar-held ones (`LLMEngine._awaiting_grammar`),
until `admit_held` at the start of a `step()` finds it a slot; held requests take
slots first come first served, and a new request waits behind them, so none starves
(vLLM's scheduler instead skips such requests in its waiting queue). Its prefix-cache key is the
adapter's (id, version), so a request never reuses KV of another adapter or of an
older version of its own. Host only: the runner's `set_lora` writes the slots.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxserve.lora import LoRARequest
from jaxserve.lora.manager import LoRASlots
from jaxserve.scheduler.request import RequestStatus

UPDATE_MODES = ("abort", "keep")


class EngineLoRA:
    """LoRA state of one `LLMEngine` (its `lora` attribute).

    Args:
      engine: the engine (its config, scheduler, runner and output processor).
      allowed_dir: adapters may only be read under this directory (None: anywhere).
    """

    def __init__(self, engine: Any, allowed_dir: str | None = None):
        self.engine = engine
        cfg = engine.config
        self.slots: LoRASlots | None = None
        if cfg.max_loras:
            write = getattr(engine.runner, "set_lora", None)
            if write is None:
                raise ValueError(f"max_loras={cfg.max_loras}: {type(engine.runner).__name__} "
                                 f"has no LoRA slots (set_lora)")
            self.slots = LoRASlots(cfg.model, max_loras=cfg.max_loras,
                                   max_rank=cfg.max_lora_rank, write=write,
                                   allowed_dir=allowed_dir)

    def _on(self) -> LoRASlots:
        if self.slots is None:
            raise ValueError("LoRA is off: build the engine with max_loras > 0 "
                             "(or enable_lora=True)")
        return self.slots

    def in_use(self, *, pinning: bool = False) -> set[int]:
        """Adapter ids of the live requests: the scheduler's and those the engine holds
        (for a grammar compile or a slot). With `pinning`, only the held ones that have
        their slot: the adapters whose slot no other adapter may take."""
        ids = {r.lora_int_id for r in self.engine.scheduler.requests.values() if r.lora_int_id}
        for p, _ in self.engine._awaiting_grammar.values():
            c = p.children[0]
            if c.lora_int_id and (c.lora_slot or not pinning):
                ids.add(c.lora_int_id)
        return ids

    def num_waiting(self) -> int:
        """Held requests waiting for a slot for their adapter."""
        return sum(1 for p, _ in self.engine._awaiting_grammar.values() if self._waits(p))

    @staticmethod
    def _waits(p: Any) -> bool:
        return bool(p.children[0].lora_int_id and not p.children[0].lora_slot)

    def _acquire(self, children: Sequence[Any]) -> bool:
        """Give `children` (one request's samples) their adapter's slot and cache key;
        False (nothing changed) when every slot is pinned by live requests."""
        slots, lid = self._on(), children[0].lora_int_id
        pinned = self.in_use(pinning=True)
        if not slots.can_acquire(lid, pinned):
            return False
        slot, key = slots.acquire(lid, pinned), slots.cache_key(lid)
        for req in children:
            req.lora_slot, req.cache_key = slot, key
        return True

    def admit_held(self) -> dict[str, Exception | None]:
        """Give held requests that wait for a slot their slot, first come first served
        (stopping at the first that finds none); returns {request_id: None, or the
        error of its slot write} of the held requests whose adapter now has its slot
        (or that need none), for `LLMEngine._admit_compiled` to queue or fail."""
        ready: dict[str, Exception | None] = {}
        blocked = False
        for rid, (p, _) in self.engine._awaiting_grammar.items():
            if self._waits(p) and not blocked:
                try:
                    blocked = not self._acquire(p.children)
                except Exception as e:  # a failed slot write ends this request alone
                    ready[rid] = e
                    continue
            if not self._waits(p):
                ready[rid] = None
        return ready

    # ------------------------------------------------------------ registry
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register (load and check) an adapter; False when already registered.

        Raises:
          ValueError: LoRA is off, or a bad adapter (rank over max_lora_rank, wrong shapes,
            an unknown target module, a path outside the allowed directory), naming the
            value and the limit; the pool is unchanged then.
        """
        return self._on().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter and zero its slot; False when unknown.

        Raises:
          ValueError: a live request uses it.
        """
        return self._on().remove(lora_int_id, self.in_use())

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters' requests (vLLM returns their ids; we return the requests)."""
        return [] if self.slots is None else self.slots.requests()

    def request_named(self, name: str) -> LoRARequest:
        """The registered adapter called `name` (the server's `model` field).

        Raises:
          ValueError: no adapter has that name.
        """
        for r in self.list_loras():
            if r.lora_name == name:
                return r
        raise ValueError(f"no LoRA adapter named {name!r} (registered: "
                         f"{[r.lora_name for r in self.list_loras()]})")

    def next_id(self) -> int:
        """An unused lora_int_id (the server's load route assigns it)."""
        return max((r.lora_int_id for r in self.list_loras()), default=0) + 1

    def attach(self, children: Sequence[Any], lora_request: LoRARequest | None) -> bool:
        """Give a new request's samples their adapter: registered on first use, a
        device slot, and the prefix-cache key. False when it must wait for a slot
        (every slot pinned by live requests, or others wait already): the engine
        holds it until `admit_held` gives it one.

        Raises:
          ValueError: LoRA is off, or a bad adapter (it could never run).
        """
        if lora_request is None:
            return True
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got "
                             f"{type(lora_request).__name__}")
        self._on().add(lora_request)
        for req in children:
            req.lora_int_id, req.lora_slot = lora_request.lora_int_id, 0
        return self.num_waiting() == 0 and self._acquire(children)

    # ------------------------------------------------------------ RL sync
    def update_lora(self, name: str, weights: Any, in_flight: str = "abort") -> int:
        """Swap an adapter's A/B (the RL step's adapter-only sync); returns its new
        version. Nothing is recompiled: the new arrays are written into its slot.

        `weights`: PEFT's flat state dict as `safetensors` loads it, or the in-memory
        tree (`jaxserve.lora.adapter.from_tree`); scaled like the adapter it replaces.
        Requests on this adapter that have started are failed with "abort" (the
        message names both versions), as `update_params` fails running requests, or
        go on over their old KV with "keep"; ones still waiting with no computed
        token run on the new weights. The adapter's old prefix-cache blocks are never
        matched again (the cache key carries the version).

        Raises:
          ValueError: LoRA is off, an unknown name or mode, or a bad tree; then nothing
            changed.
        """
        if in_flight not in UPDATE_MODES:
            raise ValueError(f"update_lora: in_flight={in_flight!r} must be one of "
                             f"{UPDATE_MODES}")
        slots, eng = self._on(), self.engine
        _, new = slots.check_update(name, weights)  # a bad tree raises here: nothing changed
        getattr(eng, "_drain", lambda: None)()  # async scheduling: no step runs over the swap
        lid, version = slots.update(name, new)
        key = slots.cache_key(lid)
        for p, _ in eng._awaiting_grammar.values():  # held: not started, new weights
            for req in p.children:
                if req.lora_int_id == lid:
                    req.cache_key = key
        failed = []
        for req in list(eng.scheduler.requests.values()):
            if req.lora_int_id != lid:
                continue
            if req.num_computed_tokens == 0 and req.num_output_tokens == 0 \
                    and req.status != RequestStatus.RUNNING:
                req.cache_key, req.block_hashes = key, []  # not started: new weights
            elif in_flight == "abort":
                failed.append(req.request_id)
        if failed:
            eng.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
            parents = eng.outputs.fail(failed, f"LoRA adapter {name!r} was updated from "
                                       f"version {version - 1} to {version} while this "
                                       f"request ran (update_lora, in_flight='abort')")
            eng._pending += eng.outputs.collect(parents)
        return version

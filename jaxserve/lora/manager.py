"""The engine's pool of `max_loras` device slots for LoRA adapters (host side, no jax).

Registered adapters are kept on the host (`LoRAAdapter`, NumPy); a request on an
adapter takes a slot at admission (`acquire`): the adapter's slot if it has one, else a
free slot, else the least-recently-used slot that no live request uses (vLLM's
LRU adapter cache; Punica / S-LoRA keep adapters in host memory the same way and page
them onto the device on demand). Slot 0 is the base model (no adapter). Writing a
slot is the runner's `set_lora(slot, adapter)`: it compiles nothing (the step's
programs read every slot).

Each adapter has a version, +1 per `update` (the RL step's new A/B); the prefix cache
keys a request's blocks on (adapter id, version) through `cache_key`, so KV computed
under old adapter weights is never reused.
"""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Collection

from jaxserve.lora import LoRARequest
from jaxserve.lora.adapter import LoRAAdapter, from_tree, load_peft_dir


@dataclass
class _Entry:
    request: LoRARequest
    adapter: LoRAAdapter
    version: int = 0
    slot: int = 0  # 0: not on the device
    generation: int = 0  # unique per (add, update) in this pool: the prefix-cache key


class LoRASlots:
    """Registered adapters and the device slots 1..max_loras.

    Args:
      cfg: the `ModelConfig` adapters are checked against.
      max_loras: device slots (>= 1).
      max_rank: the largest rank a slot holds (`max_lora_rank`).
      write: `(slot, adapter or None)` -> writes (or zeroes) a device slot.
      allowed_dir: when set, a path must resolve under it (the server's
        `--allowed_weights_dir`).
    """

    def __init__(self, cfg: Any, *, max_loras: int, max_rank: int,
                 write: Callable[[int, LoRAAdapter | None], None],
                 allowed_dir: str | None = None):
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        self._write = write
        self.allowed_dir = allowed_dir
        self._by_id: dict[int, _Entry] = {}
        self._slots: list[int] = [0] * (max_loras + 1)  # slot -> lora_int_id (0: free)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # slots
        self._generations = itertools.count(1)

    # ------------------------------------------------------------ registry
    def load(self, source: Any, *, scaling: float | None = None) -> LoRAAdapter:
        """A checked `LoRAAdapter` from a PEFT directory or an in-memory tree / state dict."""
        if isinstance(source, (str, os.PathLike)):
            path = os.path.realpath(source)
            if self.allowed_dir is not None:
                root = os.path.realpath(self.allowed_dir)
                if os.path.commonpath([root, path]) != root:
                    raise ValueError(f"LoRA path {str(source)!r} is outside the allowed "
                                     f"directory {root!r}")
            if not os.path.isdir(path):
                raise ValueError(f"LoRA path {str(source)!r} is not a directory")
            return load_peft_dir(self.cfg, path, max_rank=self.max_rank)
        if isinstance(source, LoRAAdapter):
            if source.rank > self.max_rank:
                raise ValueError(f"LoRA rank {source.rank} exceeds max_lora_rank={self.max_rank}")
            return source
        if not hasattr(source, "items"):
            raise ValueError(f"LoRA source must be a PEFT directory or a tree of arrays, got "
                             f"{type(source).__name__}")
        return from_tree(self.cfg, source, max_rank=self.max_rank, scaling=scaling)

    def add(self, request: LoRARequest) -> bool:
        """Register an adapter (loaded and checked now; on the device when a request
        uses it). False if this id is already registered under the same name.

        Raises:
          ValueError: a bad adapter (see `load`), or an id / name registered otherwise.
        """
        old = self._by_id.get(request.lora_int_id)
        if old is not None:
            if old.request.lora_name != request.lora_name:
                raise ValueError(f"lora_int_id={request.lora_int_id} is already adapter "
                                 f"{old.request.lora_name!r}")
            return False
        if self.id_of(request.lora_name) is not None:
            raise ValueError(f"lora_name={request.lora_name!r} is already registered with "
                             f"lora_int_id={self.id_of(request.lora_name)}")
        self._by_id[request.lora_int_id] = _Entry(request, self.load(request.lora_path),
                                                  generation=next(self._generations))
        return True

    def remove(self, lora_int_id: int, in_use: Collection[int] = ()) -> bool:
        """Unregister an adapter and free its slot; False if it is not registered.

        Raises:
          ValueError: a live request uses it.
        """
        e = self._by_id.get(lora_int_id)
        if e is None:
            return False
        if lora_int_id in in_use:
            raise ValueError(f"LoRA adapter {e.request.lora_name!r} (id {lora_int_id}) is in "
                             f"use by a live request; abort or finish it first")
        if e.slot:
            self._free(e.slot)
        del self._by_id[lora_int_id]
        return True

    def update(self, name: str, weights: Any) -> tuple[int, int]:
        """New A/B for a registered adapter (same targets' shapes; B scaled with the
        adapter's own scale unless the tree gives "scaling"); rewrites its slot if it has
        one. Returns (lora_int_id, new version). On any error nothing changes.

        Raises:
          ValueError: an unknown name, or a bad tree (see `load`).
        """
        lid, new = self.check_update(name, weights)
        e = self._by_id[lid]
        if e.slot:
            self._write(e.slot, new)
        e.adapter, e.version, e.generation = new, e.version + 1, next(self._generations)
        return lid, e.version

    def check_update(self, name: str, weights: Any) -> tuple[int, LoRAAdapter]:
        """(lora_int_id, the checked new adapter) of an `update`; changes nothing.

        Raises:
          ValueError: an unknown name, or a bad tree (see `load`).
        """
        lid = self.id_of(name)
        if lid is None:
            raise ValueError(f"no LoRA adapter named {name!r} (registered: {self.names()})")
        return lid, self.load(weights, scaling=self._by_id[lid].adapter.scaling)

    def id_of(self, name: str) -> int | None:
        return next((i for i, e in self._by_id.items() if e.request.lora_name == name), None)

    def names(self) -> list[str]:
        return [e.request.lora_name for e in self._by_id.values()]

    def requests(self) -> list[LoRARequest]:
        return [e.request for e in self._by_id.values()]

    def cache_key(self, lora_int_id: int) -> bytes:
        """The prefix-cache root key of a request on this adapter: unique per adapter
        weights ever registered here (an id removed and added again gets a new one)."""
        return f"lora:{lora_int_id}:{self._by_id[lora_int_id].generation}".encode()

    def version(self, lora_int_id: int) -> int:
        return self._by_id[lora_int_id].version

    # ------------------------------------------------------------ slots
    def slot_of(self, lora_int_id: int) -> int:
        e = self._by_id.get(lora_int_id)
        return e.slot if e is not None else 0

    def can_acquire(self, lora_int_id: int, in_use: Collection[int]) -> bool:
        """Whether `acquire` finds a slot now: the adapter has one, one is free, or one
        holds an adapter that no live request uses (`in_use`)."""
        e = self._by_id.get(lora_int_id)
        return e is None or bool(e.slot) or any(
            self._slots[s] not in in_use for s in range(1, self.max_loras + 1))

    def acquire(self, lora_int_id: int, in_use: Collection[int]) -> int:
        """The device slot of a registered adapter, writing it into a free or the
        least-recently-used unused slot when it has none; marks it recently used.

        Raises:
          ValueError: an unregistered id, or every slot held by adapters of live requests.
        """
        e = self._by_id.get(lora_int_id)
        if e is None:
            raise ValueError(f"lora_int_id={lora_int_id} is not a registered adapter; "
                             f"add_lora first (registered: {self.names()})")
        if not e.slot:
            slot = next((s for s in range(1, self.max_loras + 1) if not self._slots[s]), 0)
            if not slot:
                slot = next((s for s in self._lru if self._slots[s] not in in_use), 0)
            if not slot:
                raise ValueError(f"all max_loras={self.max_loras} LoRA slots hold adapters of "
                                 f"live requests; adapter {e.request.lora_name!r} must wait "
                                 f"(raise max_loras)")
            self._write(slot, e.adapter)  # first: a failed write changes nothing
            if self._slots[slot]:
                self._by_id[self._slots[slot]].slot = 0
            self._slots[slot], e.slot = lora_int_id, slot
        self._lru.pop(e.slot, None)
        self._lru[e.slot] = None
        return e.slot

    def _free(self, slot: int) -> None:
        self._write(slot, None)
        self._slots[slot] = 0
        self._lru.pop(slot, None)

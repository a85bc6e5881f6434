"""Paged KV block pool with reference counts and a hash-chained prefix cache.

The pool has `num_kv_blocks` blocks of `block_size` token slots (PagedAttention,
Kwon et al. SOSP'23). Block 0 is the reserved null block: padding writes go
there and it is never handed out, so `num_kv_blocks - 1` blocks are usable.

Prefix caching (vLLM's automatic prefix caching): every *full* block of a
request's tokens has a hash chained over its parent,
h_j = blake2b(h_{j-1} || tokens of block j), so equal hashes mean equal whole
prefixes. A block becomes cached (hittable) only once its KV has been written,
i.e. `commit()` after the step ran; a later request whose prefix matches takes
the cached blocks by reference count instead of recomputing them. A freed
cached block keeps its contents in the free queue and is reused until it is
evicted, least recently freed first. Hit blocks are full, and the last prompt
token is always recomputed, so a cached block is never written by a second
owner. As nano-vllm does, every `allocate` has a `can_allocate` that the
scheduler asks first, so an allocation never half-fails.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Iterable, Sequence

from jaxserve.scheduler.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: 16-byte blake2b of (parent hash, token ids as native
    int64s)."""
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"{n}q").pack  # = array("q", ids).tobytes()
    return hashlib.blake2b((parent or b"") + pack(*token_ids), digest_size=16).digest()


_PACKERS: dict[int, object] = {}


class KVCacheManager:
    """Block allocator of one KV pool, with optional prefix caching.

    Args:
      num_kv_blocks: N, blocks in the pool including the null block 0 (>= 2).
      block_size: B, token slots per block.
      enable_prefix_caching: reuse full blocks across requests by content hash.

    Counters: `num_blocks` (usable, N - 1), `num_free_blocks` (free list,
    including cached blocks nobody holds, which are evictable), `usage`
    (fraction of usable blocks held by requests), `prefix_cache_queries` /
    `prefix_cache_hits` (prompt tokens looked up at admission / found
    cached), `num_evictions`.
    """

    def __init__(self, num_kv_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if not isinstance(num_kv_blocks, int) or num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks={num_kv_blocks!r} must be an int >= 2 "
                             "(block 0 is the reserved null block)")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_kv_blocks  # owners per block
        self._hash: list[bytes | None] = [None] * num_kv_blocks  # cached content, if any
        # Free blocks in eviction order: the front is taken first. Uncached
        # blocks go to the front, cached ones to the back (LRU).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_kv_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> block holding that content
        self._req_blocks: dict[str, list[int]] = {}
        self._req_tuple: dict[str, tuple[int, ...]] = {}  # cached tuple(self._req_blocks[rid])
        self._req_committed: dict[str, int] = {}  # leading blocks already committed
        self._no_commit: set[str] = set()  # live requests whose KV predates a weight swap
        self._later: list[tuple[Request, int]] = []  # `commit_later`'s, not yet made
        self._evicted: set[bytes] = set()  # hashes evicted while commits were queued
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ------------------------------------------------------------ gauges
    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded): free + used == num_blocks."""
        return self.num_kv_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_kv_blocks - 1 - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered in the prefix cache (held or free)."""
        self.flush_commits()
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (evictable cached blocks count as free)."""
        return self.num_used_blocks / (self.num_kv_blocks - 1)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block-table row (cached tuple; () if it holds none)."""
        t = self._req_tuple.get(request_id)
        if t is None:
            t = tuple(self._req_blocks.get(request_id, ()))
            self._req_tuple[request_id] = t
        return t

    # ------------------------------------------------------------ hashing
    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the first num_blocks full blocks of the request's tokens (memoised)."""
        hashes = request.block_hashes
        B = self.block_size
        toks = request.all_token_ids
        while len(hashes) < num_blocks:
            j = len(hashes)
            # The first block chains on the request's cache key (its LoRA adapter and
            # version, issue 27; vLLM's extra_keys), so KV of another adapter never matches.
            hashes.append(hash_block(hashes[-1] if hashes else getattr(request, "cache_key", None),
                                     toks[j * B:(j + 1) * B]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids, tokens).

        At most (num_tokens - 1) // B blocks, so the last token (of a prompt
        that is an exact multiple of B, too) is always computed: its logits
        are needed and its block must be written by this request alone. A request
        with `logprob_start` j takes hits only below position j - 1.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.flush_commits()
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.logprob_start is not None:
            # Prompt token j's logprob needs the hidden row of position j - 1 computed
            # here, so hits stop before it (vLLM skips the cache for prompt_logprobs).
            max_blocks = min(max_blocks, (request.logprob_start - 1) // self.block_size)
        hit = []
        # [:max_blocks]: the memo may already hold more hashes (a deferred or preempted
        # request's), which must not extend the hit past the cap.
        for h in self.block_hashes(request, max_blocks)[:max_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------ allocation
    def _num_new_blocks(self, request: Request, num_new_tokens: int, num_hits: int) -> int:
        held = len(self._req_blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        return -(-total // self.block_size) - held - num_hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Sequence[int] = ()) -> bool:
        """Whether `allocate` with the same arguments would succeed.

        Hit blocks that nobody holds sit in the free list, so taking them
        costs free blocks too.
        """
        need = self._num_new_blocks(request, num_new_tokens, len(new_computed_blocks))
        if new_computed_blocks:
            need += sum(1 for b in new_computed_blocks if self._ref[b] == 0)
        return need <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int,
                 new_computed_blocks: Sequence[int] = ()) -> list[int]:
        """Take the hit blocks, then fresh blocks until the request's slots cover
        num_computed_tokens + len(hits) * B + num_new_tokens tokens.

        Returns the fresh block ids. Raises RuntimeError when `can_allocate` is
        False (a scheduler bug: it must ask first); nothing is changed then.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            raise RuntimeError(f"allocate({request.request_id!r}, {num_new_tokens}) without "
                               f"room: {len(self._free)} free blocks")
        need = self._num_new_blocks(request, num_new_tokens, len(new_computed_blocks))
        rid = request.request_id
        blocks = self._req_blocks.setdefault(rid, [])
        for b in new_computed_blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            blocks.append(b)
        fresh = [self._take_free() for _ in range(max(need, 0))]
        if fresh or new_computed_blocks:
            blocks.extend(fresh)
            self._req_tuple.pop(rid, None)
        if new_computed_blocks:
            self._req_committed[rid] = len(new_computed_blocks)
        return fresh

    def _take_free(self) -> int:
        """The least recently freed block, now held once (evicted from the prefix cache if
        it was cached there)."""
        b, _ = self._free.popitem(last=False)
        h = self._hash[b]
        if h is not None:
            del self._cached[h]
            self._hash[b] = None
            self.num_evictions += 1
            if self._later:  # a queued commit sees h as cached, as it was when queued
                self._evicted.add(h)
        self._ref[b] = 1
        return b

    def try_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """`allocate(request, num_new_tokens)` if `can_allocate`, in one call.

        The per-step path of a running request: most decode steps fit in the
        last block already and cost one comparison.
        """
        blocks = self._req_blocks.get(request.request_id)
        held = len(blocks) if blocks else 0
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - held
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        if need == 1 and blocks:  # a decode row's next block, without `allocate`'s checks
            blocks.append(self._take_free())
            self._req_tuple.pop(request.request_id, None)
            return True
        self.allocate(request, num_new_tokens)
        return True

    def commit(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's full, computed blocks in the prefix cache (only those
        within its first `num_tokens` tokens, when given).

        Called after the step that wrote their KV, or (a plan made ahead,
        `Scheduler._commit_inputs`) once that step is dispatched: every step that can read
        them runs after it. A block whose content is already cached elsewhere stays
        private (one cached copy per hash). A request that holds no blocks (freed since)
        is skipped. Any `commit_later` still pending is made first.
        """
        if not self.enable_prefix_caching:
            return
        if self._later:  # (the check inline: called for each row whose block filled)
            self.flush_commits()
        self._commit(request, num_tokens)

    def commit_later(self, items: Iterable[tuple[Request, int]]) -> None:
        """`commit(request, num_tokens)` for each item, made by `flush_commits` (the engine
        calls it once the plan being made is dispatched: hashing is off the path from plan
        to device) or before anything that could tell the difference: a lookup, a free, a
        reset, another commit, a check (an eviction meanwhile is remembered instead,
        `flush_commits`). So the cache is always the one committing at once would give
        whenever it is read."""
        if self.enable_prefix_caching:
            self._later.extend(items)

    def flush_commits(self) -> None:
        """Make the commits `commit_later` queued, in order. A hash evicted since they were
        queued counts as still cached (committing at once would have found it so and left
        the block private; the eviction then dropped it either way)."""
        if not self._later:
            return
        later, self._later = self._later, []
        evicted, self._evicted = self._evicted, set()
        for request, n in later:
            self._commit(request, n, evicted)

    def _commit(self, request: Request, num_tokens: int | None,
                evicted: set[bytes] = frozenset()) -> None:
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if not blocks or rid in self._no_commit:  # freed; KV partly from weights before a swap
            return
        # Only blocks whose tokens are all known (a plan made ahead may have advanced
        # num_computed_tokens over a placeholder: that block waits for its token).
        c, n = request.num_computed_tokens, len(request.all_token_ids)
        if num_tokens is not None:
            c = min(c, num_tokens)
        n_full = (c if c < n else n) // self.block_size
        committed = self._req_committed
        start = committed.get(rid, 0)
        if n_full <= start:
            return
        hashes = request.block_hashes
        if len(hashes) < n_full:
            hashes = self.block_hashes(request, n_full)
        hash_of, cached = self._hash, self._cached
        for j in range(start, n_full):
            b, h = blocks[j], hashes[j]
            if hash_of[b] is None and h not in cached and h not in evicted:
                hash_of[b] = h
                cached[h] = b
        committed[rid] = n_full

    def free(self, request_id: str) -> int:
        """Drop the request's hold on its blocks; returns how many it held.

        Blocks reaching zero owners join the free list: uncached ones at the
        front (nothing worth keeping), cached ones at the back in reverse
        order, so a prefix's tail is evicted before its head.
        """
        self.flush_commits()
        blocks = self._req_blocks.pop(request_id, None)
        self._req_tuple.pop(request_id, None)
        self._req_committed.pop(request_id, None)
        self._no_commit.discard(request_id)
        if not blocks:
            return 0
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    self._free.move_to_end(b, last=False)
        return len(blocks)

    def reset_prefix_cache(self, *, stale_held: bool = False) -> int:
        """Forget every cached block nobody holds; returns how many.

        stale_held: the KV of the blocks requests hold is stale too (the weights changed
        under requests that keep their KV, issue 28's "keep"): forget their hashes as
        well, and never commit those requests' later blocks (they mix both weights'
        KV); a later hit would hand old-weight KV to a new request.
        """
        self.flush_commits()
        n = 0
        if stale_held:
            for rid, blocks in self._req_blocks.items():
                self._no_commit.add(rid)
                for b in blocks:
                    h = self._hash[b]
                    if h is not None:
                        del self._cached[h]
                        self._hash[b] = None
                        n += 1
        for b in self._free:
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
                self._hash[b] = None
                n += 1
        return n

    # ------------------------------------------------------------ checks
    def owners(self) -> dict[str, tuple[int, ...]]:
        """request_id -> blocks held (a copy, for tests and debugging)."""
        return {r: tuple(b) for r, b in self._req_blocks.items()}

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        self.flush_commits()
        return self._hash[block_id] is not None

    def check_invariants(self, live_request_ids: Iterable[str] | None = None) -> None:
        """Assert the pool's bookkeeping is consistent; raises AssertionError if not.

        free + held == usable; the null block is never free nor held; each
        block's ref count equals its number of holders; free blocks have
        ref 0; the hash index and per-block hashes agree.
        """
        self.flush_commits()
        held: dict[int, int] = {}
        for rid, blocks in self._req_blocks.items():
            assert len(set(blocks)) == len(blocks), f"{rid} holds a block twice: {blocks}"
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        assert 0 not in held and 0 not in self._free, "the null block 0 was handed out"
        assert not set(held) & set(self._free), "a block is both free and held"
        assert len(held) + len(self._free) == self.num_kv_blocks - 1, (
            f"held {len(held)} + free {len(self._free)} != usable {self.num_kv_blocks - 1}")
        for b in range(1, self.num_kv_blocks):
            assert self._ref[b] == held.get(b, 0), f"block {b}: ref {self._ref[b]} != holders"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"cache index points at block {b} with another hash"
        assert sum(h is not None for h in self._hash) == len(self._cached)
        if live_request_ids is not None:
            assert set(self._req_blocks) <= set(live_request_ids), (
                f"blocks held by dead requests: {set(self._req_blocks) - set(live_request_ids)}")

"""Multi-host serving on JAX's multi-controller runtime: one process per host, one leader.

`initialize` starts `jax.distributed` (CPU collectives through gloo, so the same
code runs on one machine's processes in tests); after it `jax.devices()` lists
every process's devices and `jaxserve.distributed.tensor_parallel.TensorParallel` builds its mesh
over them unchanged. Every process builds the same `ModelRunner` (each places
only the shards of its own devices) and compiles the same AOT programs.

The scheduler runs in process 0 only (the leader, `Leader`). Each step's plan
(the bucket-shaped host arrays of `ModelRunner._host_batch`) reaches the other
processes (the followers, `follower_loop`) in ONE broadcast per step
(`jax.experimental.multihost_utils.broadcast_one_to_all`) of a fixed-size i32
buffer: a header (op, T_pad, S_pad, payload bytes) then the arrays' bytes. Its
size is fixed by the largest bucket, so the broadcast is one program, compiled
at start-up by a first no-op message. Followers rebuild the arrays from the
header's bucket (`ModelRunner.padding_batch(T_pad, S_pad)` gives the tree, shapes
and dtypes), then every process runs `ModelRunner.run_host_batch` on it: the same
program in lock-step, whose collectives join them. Op STOP ends the followers'
loop; the leader sends it when it stops (explicitly, or at interpreter exit).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

OP_NOOP, OP_STEP, OP_STOP = 0, 1, 2
_HEADER = 4  # i32 words: op, T_pad, S_pad, payload bytes


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               cpu_collectives: str = "gloo") -> None:
    """`jax.distributed.initialize` for one process of a multi-host run (call before any
    other jax use). `cpu_collectives` selects the CPU cross-process collectives
    (jax config `jax_cpu_collectives_implementation`; ignored by GPU/TPU devices).

    Raises:
      ValueError: num_processes < 1 or process_id outside [0, num_processes).
    """
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must lie in [0, num_processes="
                         f"{num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", process_id,
                num_processes, jax.local_device_count(), jax.device_count())


class StepChannel:
    """The fixed-size broadcast of one step's host arrays (see the module docstring).

    Args:
      runner: the process's `ModelRunner` (its bucket policy fixes the buffer size
        and its `padding_batch` the tree of every bucket).
    """

    def __init__(self, runner: Any):
        self.runner = runner
        pol = runner.bucket_policy
        biggest = runner.padding_batch(pol.token_buckets[-1], pol.seq_buckets[-1])
        self.max_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(biggest))
        self.words = _HEADER + -(-self.max_bytes // 4)
        self.is_leader = jax.process_index() == 0

    def _broadcast(self, buf: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.is_leader))

    def send(self, op: int, t_pad: int = 0, s_pad: int = 0, host: Any = None) -> None:
        """Leader: broadcast one message.

        Raises:
          ValueError: a batch larger than the buffer (a bucket outside the policy).
        """
        payload = b"".join(np.ascontiguousarray(np.asarray(x)).tobytes()
                           for x in jax.tree.leaves(host)) if host is not None else b""
        if len(payload) > self.max_bytes:
            raise ValueError(f"step batch of {len(payload)} bytes at bucket ({t_pad}, {s_pad}) "
                             f"exceeds the broadcast buffer of {self.max_bytes} bytes")
        buf = np.zeros(self.words, np.int32)
        buf[:_HEADER] = (op, t_pad, s_pad, len(payload))
        buf[_HEADER:].view(np.uint8)[:len(payload)] = np.frombuffer(payload, np.uint8)
        self._broadcast(buf)

    def recv(self) -> tuple[int, int, int, Any]:
        """Follower: the next message as (op, T_pad, S_pad, host batch or None)."""
        buf = self._broadcast(np.zeros(self.words, np.int32))
        op, t_pad, s_pad, n = (int(x) for x in buf[:_HEADER])
        if op != OP_STEP:
            return op, t_pad, s_pad, None
        template = self.runner.padding_batch(t_pad, s_pad)
        leaves, treedef = jax.tree.flatten(template)
        raw, off, out = buf[_HEADER:].view(np.uint8)[:n], 0, []
        for x in leaves:
            x = np.asarray(x)
            out.append(np.frombuffer(raw[off:off + x.nbytes].tobytes(), x.dtype).reshape(x.shape))
            off += x.nbytes
        if off != n:
            raise RuntimeError(f"step message of {n} bytes does not match bucket ({t_pad}, "
                               f"{s_pad}), whose arrays take {off}")
        return op, t_pad, s_pad, jax.tree.unflatten(treedef, out)


class Leader:
    """Process 0's side: `send_step` is the runner's step listener
    (`ModelRunner.set_step_listener(leader.send_step)`), called before each device step;
    `stop()` (also run at interpreter exit) releases the followers.
    """

    def __init__(self, runner: Any):
        self.channel = StepChannel(runner)
        self.channel.send(OP_NOOP)  # compiles the broadcast now, in every process
        self._stopped = False
        atexit.register(self.stop)

    def send_step(self, t_pad: int, s_pad: int, host: Any) -> None:
        if self._stopped:
            raise RuntimeError("the multi-host leader was stopped; its followers are gone")
        self.channel.send(OP_STEP, t_pad, s_pad, host)

    def stop(self) -> None:
        """Tell every follower to leave its loop (idempotent)."""
        if not self._stopped:
            self._stopped = True
            self.channel.send(OP_STOP)


def follower_loop(runner: Any) -> int:
    """A follower's life after warm-up: run each step the leader broadcasts, in lock-step,
    until OP_STOP. Returns the number of steps run."""
    channel = StepChannel(runner)
    steps = 0
    while True:
        op, t_pad, s_pad, host = channel.recv()
        if op == OP_STOP:
            logger.info("follower %d: stop after %d steps", jax.process_index(), steps)
            return steps
        if op == OP_STEP:
            runner.run_host_batch(host, t_pad, s_pad)
            steps += 1

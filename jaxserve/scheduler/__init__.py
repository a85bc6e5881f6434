"""Host-side scheduling: plain Python + NumPy, never jax or flax.

`Scheduler` plans each step, `KVCacheManager` owns the block pool and prefix
cache, and `BucketPolicy` picks the padded (T_pad, S_pad) shape. The plan
(`SchedulerOutput`) goes to the runner, which lays it out as arrays
(`jaxserve.worker.input_batch`).
"""

from jaxserve.scheduler.buckets import BucketPolicy, pow2_buckets, pow2_linear_buckets
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.output import ScheduledRequest, SchedulerOutput
from jaxserve.scheduler.scheduler import Scheduler

__all__ = ["BucketPolicy", "KVCacheManager", "ScheduledRequest", "Scheduler", "SchedulerOutput",
           "pow2_buckets", "pow2_linear_buckets"]

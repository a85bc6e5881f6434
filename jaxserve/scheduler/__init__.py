"""Host-side scheduling: plain Python + NumPy, never jax or flax.

`Scheduler` plans each step, `KVCacheManager` owns the block pool and prefix
cache, `BucketPolicy` picks the padded (T_pad, S_pad) shape and
`build_batch` turns a plan into the step's NumPy arrays.
"""

from jaxserve.scheduler.batch import BatchArrays, build_batch
from jaxserve.scheduler.buckets import (BucketPolicy, fit_buckets, pow2_buckets,
                                        pow2_linear_buckets)
from jaxserve.scheduler.kv_cache_manager import KVCacheManager
from jaxserve.scheduler.output import ScheduledRequest, SchedulerOutput
from jaxserve.scheduler.scheduler import Scheduler

__all__ = ["BatchArrays", "BucketPolicy", "KVCacheManager", "ScheduledRequest", "Scheduler",
           "SchedulerOutput", "build_batch", "fit_buckets", "pow2_buckets", "pow2_linear_buckets"]

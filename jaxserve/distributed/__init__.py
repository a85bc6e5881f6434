"""Tensor parallelism (`tensor_parallel`) and multi-host serving (`multihost`)."""

"""The runner (vLLM V1's worker layer): turns a `SchedulerOutput` into sampled tokens.

  runner.py            the `Runner` protocol and its result types (plain NumPy)
  input_batch.py       host batch layout: a plan -> padded arrays (NumPy)
  scoring.py           host half of prompt logprobs / scoring
  model_runner.py      `ModelRunner`: device state and `execute`
  programs.py          the step functions (stack, head, score) and compile accounting
  layer_stack.py       a token bucket's stack as embed / G-layer / final programs
  warmup.py            building the program table ahead of time
  kv_cache.py          KV pool sizing
  executable_cache.py  serialized AOT executables on disk
  fake_runner.py       `FakeRunner`: scripted tokens, no model (tests, host benchmarks)
  host_memory.py       glibc malloc policy of a serving process (mmap threshold, trim)

Importing this package imports nothing heavy; import the module you need.
"""

"""Deviceless GPU compiles: every engine program built for a named GPU (H200, H100, A100)
on a machine without one (issue 25; ../shared/gpu/NOTES.md).

  targets     the GPU target descriptions (targets/*.txtpb) and `load_target`
  venv        the plugin venv (.venv-gpu) the compiles run in
  compile     `compile_for_target`: checks, then the worker in that venv, per-program records
  deviceless  the worker: a ModelRunner over compile-only GPUs with abstract weights
  report      ptxas / HLO / memory_analysis parsing and the text report
  command     the `jaxserve compile --target=...` command
"""

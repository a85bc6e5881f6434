"""The walls of the layout (issue 23): what each layer may import, no import cycles,
and the size limits that keep one job per file."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from architecture.imports import PKG_ROOT, all_modules, cycles, import_graph

# The one lazy import the engine may make below the runner protocol: building the
# default `ModelRunner` when `LLMEngine(config, params, tokenizer)` is given no runner.
ENGINE_RUNNER_FACTORY = ("jaxserve.engine.core", "jaxserve.worker.model_runner")
DEVICE_SIDE = ("jaxserve.worker", "jaxserve.model", "jaxserve.attention", "jaxserve.sample",
               "jaxserve.distributed")
HOST_ALLOWED = ("jaxserve.worker.runner", "jaxserve.sample.metadata")


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_no_import_cycles():
    """Lazy imports inside functions count; a cycle is a layer calling back up."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    # the checker itself: a two-module loop and a three-module triangle are found
    g = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert cycles(g) == [["a", "b"], ["c", "d", "e"]]


def test_engine_and_scheduler_load_no_jax_or_flax():
    """In a fresh interpreter, importing the host layers loads no jax*/flax* module,
    directly or through another jaxserve module."""
    code = ("import sys, json, jaxserve.engine, jaxserve.scheduler\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))))")
    env = {**os.environ, "PYTHONPATH": str(PKG_ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_engine_uses_only_the_runner_protocol_from_the_device_side():
    bad = []
    for mod, edges in import_graph().items():
        if not _under(mod, ("jaxserve.engine", "jaxserve.scheduler")):
            continue
        for dst in edges:
            if _under(dst, DEVICE_SIDE) and not _under(dst, HOST_ALLOWED) \
                    and (mod, dst) != ENGINE_RUNNER_FACTORY:
                bad.append((mod, dst))
    assert bad == []


def test_scheduler_imports_nothing_above_it():
    bad = [(m, d) for m, edges in import_graph().items() if _under(m, ("jaxserve.scheduler",))
           for d in edges if _under(d, ("jaxserve.engine", "jaxserve.worker", "jaxserve.server",
                                        "jaxserve.llm", "jaxserve.cli"))]
    assert bad == []


def test_at_most_ten_modules_at_the_top():
    top = sorted(p.name for p in PKG_ROOT.glob("*.py"))
    assert len(top) <= 10, top


def test_no_file_over_500_lines_and_no_function_over_80():
    long_files, long_fns = [], []
    for mod, path in all_modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            long_files.append((mod, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80 and (mod, node.name) != ("jaxserve.server.api_server", "build_app"):
                    long_fns.append((mod, node.name, n))  # build_app: the route table
    assert long_files == [] and long_fns == []


def test_runner_classes_have_one_home():
    homes = {"ModelRunner": [], "FakeRunner": []}
    for mod, path in all_modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in homes:
                homes[node.name].append(mod)
    assert homes == {"ModelRunner": ["jaxserve.worker.model_runner"],
                     "FakeRunner": ["jaxserve.worker.fake_runner"]}


def test_public_imports_keep_working():
    from jaxserve import LLM, SamplingParams  # noqa: F401
    from jaxserve.checkpoint import loader  # noqa: F401
    from jaxserve.config import ModelConfig  # noqa: F401
    from jaxserve.engine import LLMEngine, make_engine_config  # noqa: F401
    from jaxserve.integrations import tunix  # noqa: F401
    from jaxserve.worker.fake_runner import FakeRunner  # noqa: F401
    from jaxserve.worker.model_runner import ModelRunner  # noqa: F401


def test_execute_takes_the_plan_alone_and_reads_no_scheduler():
    """`execute(plan)`: one parameter, no extras; no scheduler state is read inside it
    (the runners' own copies of the requests come from the plan)."""
    import inspect
    import textwrap

    from jaxserve.worker.fake_runner import FakeRunner
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.worker.runner import Runner

    for cls in (Runner, ModelRunner, FakeRunner):
        params = list(inspect.signature(cls.execute).parameters.values())
        assert [p.name for p in params] == ["self", "out"], (cls, params)
        assert params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert params[1].default is inspect.Parameter.empty
        names = {n.attr if isinstance(n, ast.Attribute) else n.id
                 for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls.execute))))
                 if isinstance(n, (ast.Attribute, ast.Name))}
        assert not names & {"scheduler", "Scheduler", "fill_bitmask"}, (cls, names)

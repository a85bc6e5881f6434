"""`compile.takes` / `aot_compile`'s check: a program is installed only if it takes the
arguments it was built for (a compile racing another once returned the other program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker import compile as comp


def _programs():
    f = jax.jit(lambda p, b: (p["w"] @ b["x"]).sum() + b["i"].sum())
    g = jax.jit(lambda p, s: p["w"].sum() * s.sum())
    fa = ({"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)},
          {"i": np.zeros(4, np.int32), "x": jax.ShapeDtypeStruct((3,), jnp.float32)})
    ga = ({"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}, np.zeros(4, np.float32))
    return f, fa, g, ga


def test_takes_tells_a_programs_own_arguments_from_anothers():
    f, fa, g, ga = _programs()
    pf, pg = f.lower(*fa).compile(), g.lower(*ga).compile()
    assert comp.takes(pf, fa) and comp.takes(pg, ga)
    assert not comp.takes(pf, ga) and not comp.takes(pg, fa)
    wrong_dtype = (fa[0], {"i": np.zeros(4, np.float32), "x": fa[1]["x"]})
    assert not comp.takes(pf, wrong_dtype)
    assert comp.takes(pf, (fa[0], {"i": np.zeros(4, np.int64), "x": fa[1]["x"]}))  # canonical


def test_aot_compile_rebuilds_a_program_for_other_arguments(monkeypatch):
    f, fa, g, ga = _programs()
    wrong = g.lower(*ga).compile()
    calls = []

    class Lowered:
        def __init__(self, real):
            self.real = real

        def compile(self):
            calls.append(1)
            return wrong if len(calls) == 1 else self.real.compile()

    class Fn:
        def lower(self, *args):
            return Lowered(f.lower(*args))

    program, how = comp.aot_compile(Fn(), fa, exec_cache=None, key_parts=None)
    assert comp.takes(program, fa) and len(calls) == 2 and how in ("built", "loaded")

    class Always:
        def lower(self, *args):
            return type("L", (), {"compile": lambda self: wrong})()

    with pytest.raises(RuntimeError, match="kept returning a program for other arguments"):
        comp.aot_compile(Always(), fa, exec_cache=None, key_parts=None)

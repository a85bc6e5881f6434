"""Issue 27: the LoRA delta of one projection, masked shrink/expand over all slots
(`jaxserve.model.lora.lora_delta`, what the engine runs) against a per-token gather of
each token's A / B (BGMV's form), on SmolLM2's projection shapes, max_loras=4, rank 16,
T = 16 and 64 tokens, every slot and slot 0 used; medians of 30 interleaved calls.

Usage: .venv/bin/python scripts/bench_lora_delta.py
"""
import sys, time, os
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax, jax.numpy as jnp, numpy as np
from jaxserve.model.lora import lora_delta
S, r = 4, 16
def gathered(h, a, b, slots):
    # BGMV: per-token gather of its slot's A [in, r] and B [r, out]; slot 0 -> a zero slot
    a0 = jnp.concatenate([jnp.zeros_like(a[:, :1]), a], axis=1)  # [in, S+1, r]
    b0 = jnp.concatenate([jnp.zeros_like(b[:1]), b], axis=0)  # [S+1, r, out]
    u = jnp.einsum("ti,itr->tr", h, a0[:, slots])
    return jnp.einsum("tr,tro->to", u, b0[slots])
res = {}
for T in (16, 64):
    for din, dout in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
        rng = np.random.default_rng(0)
        h = jnp.asarray(rng.normal(size=(T, din)), jnp.float32)
        a = jnp.asarray(rng.normal(size=(din, S, r)), jnp.float32)
        b = jnp.asarray(rng.normal(size=(S, r, dout)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(din, dout)), jnp.float32)
        slots = jnp.asarray(np.arange(T) % (S + 1), jnp.int32)
        fns = {"base": jax.jit(lambda h, a, b, s: h @ w), "masked": jax.jit(lambda h, a, b, s: h @ w + lora_delta(h, a, b, s)),
               "gathered": jax.jit(lambda h, a, b, s: h @ w + gathered(h, a, b, s))}
        np.testing.assert_allclose(fns["masked"](h, a, b, slots), fns["gathered"](h, a, b, slots), rtol=1e-3, atol=1e-2)
        t = {k: [] for k in fns}
        for f in fns.values(): f(h, a, b, slots).block_until_ready()
        for _ in range(30):
            for k, f in fns.items():
                t0 = time.perf_counter(); f(h, a, b, slots).block_until_ready(); t[k].append(time.perf_counter() - t0)
        med = {k: 1e6 * np.median(v) for k, v in t.items()}
        print(f"T={T} {din}x{dout}: " + "  ".join(f"{k} {v:.0f}us" for k, v in med.items()))
print("load", os.getloadavg()[0])

"""Admin routes: load new weights from disk without restarting; pause and resume
generation around a weight swap (issue 28).

POST /admin/pause {"mode": "abort"|"wait"|"keep"|"retract"} and POST /admin/resume
are vLLM's `pause_generation(mode=...)` / `resume_generation()` (SGLang's
/pause_generation and /continue_generation): see `LLMEngine.pause_generation` for the
modes ("wait" answers once the running requests finished). While paused, requests
are accepted and wait; /health reports `"paused": true` and the mode. Pausing twice or
resuming when not paused is a 409; an unknown mode a 400 naming the choices.

POST /admin/sleep {"level": 1|2, "mode", "reject_new", "discard_weights"} and
POST /admin/wake_up {"tags": ["weights", "kv_cache"] | null} are vLLM's /sleep and
/wake_up (`LLMEngine.sleep` / `wake_up`): level 1 frees the KV cache, level 2 the
weights too. While asleep, requests wait for the wake, or with `reject_new` get a 503
at once; /health reports `"is_sleeping": true`. Sleeping twice or waking when awake
is a 409. Like the weight route, all of these exist only with an API key.

POST /admin/update_weights_from_disk {"model_path": "..."} (SGLang's
`update_weights_from_disk` is the anchor; its field name). The checkpoint is read
with the project's loaders (`jaxserve.checkpoint.load_model`: GGUF, HF
safetensors, the params cache) off the engine thread, so serving goes on while
it loads; the swap itself (`LLMEngine.update_params`: validation, no recompile,
prefix cache forgotten) runs on the engine thread between steps.

Rules:
- The route exists only when the server has an API key (it changes what every
  client gets), and needs the same bearer token.
- It reads only under `--allowed_weights_dir`: the path (relative paths are taken
  inside it) and every file of a checkpoint directory must resolve, symlinks
  followed, inside that directory; otherwise 403 naming the path and the dir.
  Without the flag it answers 403 saying so.
- One update at a time: a second one while the first is loading or swapping is 409.
- Requests in flight when the weights swap follow the body's `in_flight` pause mode
  (`LLMEngine.update_params(params, in_flight=...)`): "abort" (the default) fails them
  (their clients get a 500 naming both weight versions), "wait" drains them on the old
  weights first, "keep" and "retract" continue them on the new weights. Later
  requests use the new weights. Sent while paused, the swap happens inside that pause.
  The tokenizer is kept; the new checkpoint must have the same architecture and
  shapes (else 400 naming the leaf, and the old weights keep serving).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from jaxserve.engine.pause import check_mode
from jaxserve.engine.sleep import SLEEP_TAGS
from jaxserve.server.protocol import APIError


class UpdateWeightsRequest(BaseModel):
    """Body of POST /admin/update_weights_from_disk (`in_flight`: a pause mode)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    in_flight: str = "abort"


class SleepRequest(BaseModel):
    """Body of POST /admin/sleep (see `LLMEngine.sleep`)."""

    model_config = ConfigDict(extra="forbid")
    level: int = 1
    mode: str = "abort"
    reject_new: bool = False
    discard_weights: bool = False


class WakeUpRequest(BaseModel):
    """Body of POST /admin/wake_up (vLLM's `tags`; None: everything)."""

    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


class PauseRequest(BaseModel):
    """Body of POST /admin/pause (vLLM's `mode`; default "abort", as vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    mode: str = "abort"


def pause_mode(mode: str, field: str) -> str:
    """`mode` if it is a pause mode, else APIError(400) naming the field and the choices."""
    try:
        return check_mode(mode)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from e


async def engine_call(aengine: Any, fn: Callable[[Any], Any], what: str) -> Any:
    """`aengine.call(fn)`; the engine's ValueError (a call that does not fit its state,
    e.g. resume when not paused) becomes a 409 naming `what`.

    Raises:
      APIError(503): the engine is not ready.
      APIError(409): the engine refused the call for its state.
    """
    if not aengine.is_ready:
        raise APIError(503, f"engine is {aengine.state}")
    try:
        return await aengine.call(fn)
    except ValueError as e:
        raise APIError(409, f"{what}: {e}") from e


def resolve_under(path: str, allowed_dir: str) -> Path:
    """The real path of `path` (relative: inside allowed_dir), which must lie in allowed_dir.

    A checkpoint directory's files are checked too (a symlink inside it may escape).

    Raises:
      APIError(403): the path, or a file under it, resolves outside allowed_dir.
      APIError(400): the path does not exist.
    """
    root = Path(os.path.realpath(allowed_dir))
    p = Path(path)
    real = Path(os.path.realpath(p if p.is_absolute() else root / p))

    def inside(x: Path) -> bool:
        return x == root or root in x.parents

    if not inside(real):
        raise APIError(403, f"model_path={path!r} resolves to {str(real)!r}, outside "
                       f"--allowed_weights_dir={str(root)!r}", param="model_path")
    if not real.exists():
        raise APIError(400, f"model_path={path!r} does not exist under "
                       f"--allowed_weights_dir={str(root)!r}", param="model_path")
    if real.is_dir():
        for dirpath, dirs, files in os.walk(real):
            for f in files + dirs:  # a symlinked sub-directory is checked too (not walked)
                fr = Path(os.path.realpath(Path(dirpath) / f))
                if not inside(fr):
                    raise APIError(403, f"model_path={path!r}: {str(Path(dirpath) / f)!r} "
                                   f"resolves to {str(fr)!r}, outside --allowed_weights_dir="
                                   f"{str(root)!r}", param="model_path")
    return real


def install_admin_routes(app: FastAPI, aengine: Any, *, api_key: str | None,
                         allowed_weights_dir: str | None, auth: Any,
                         params_cache_dir: str | None = None,
                         loader: Callable[..., Any] | None = None) -> None:
    """Add the admin route to `app` when `api_key` is set (else nothing: it is a 404).

    Args:
      aengine: the `AsyncEngine`; `auth`: the API-key dependency of /v1 routes.
      params_cache_dir: passed to `load_model` (None: no params cache).
      loader: `load_model`-like `(path, dtype=, cache_dir=, progress=) -> (cfg, params,
        tokenizer)`; default `jaxserve.checkpoint.load_model`.
    """
    if api_key is None:
        return
    busy = threading.Lock()
    install_pause_routes(app, aengine, auth=auth)

    @app.post("/admin/update_weights_from_disk", dependencies=[Depends(auth)])
    async def update_weights_from_disk(req: UpdateWeightsRequest) -> JSONResponse:
        if allowed_weights_dir is None:
            raise APIError(403, "loading weights from disk is off: start the server with "
                           "--allowed_weights_dir", param="model_path")
        if not aengine.is_ready:
            raise APIError(503, f"engine is {aengine.state}")
        pause_mode(req.in_flight, "in_flight")
        real = resolve_under(req.model_path, allowed_weights_dir)
        if not busy.acquire(blocking=False):
            raise APIError(409, "a weight update is already in progress; retry when it is done")
        try:
            load = loader
            if load is None:
                from jaxserve.checkpoint import load_model as load
            dtype = str(aengine.engine.config.model.dtype)
            t0 = time.perf_counter()
            try:
                cfg, params, _ = await asyncio.to_thread(load, real, dtype=dtype,
                                                         cache_dir=params_cache_dir,
                                                         progress=False)
            except Exception as e:  # any loader's error (GGUF, safetensors, orbax) is the path's
                raise APIError(400, f"model_path={req.model_path!r}: {type(e).__name__}: {e}",
                               param="model_path") from e
            served = aengine.engine.config.model
            if cfg is not None and served is not None and cfg != served:
                diff = sorted(f for f in served.__dataclass_fields__
                              if getattr(cfg, f, None) != getattr(served, f))
                raise APIError(400, f"model_path={req.model_path!r}: its model config differs "
                               f"from the served model's in {diff}", param="model_path")
            t1 = time.perf_counter()
            try:
                version = await aengine.call(
                    lambda eng: eng.update_params(params, in_flight=req.in_flight))
            except ValueError as e:  # shapes/dtypes that do not fit the served model
                raise APIError(400, f"model_path={req.model_path!r}: {e}",
                               param="model_path") from e
            t2 = time.perf_counter()
        finally:
            busy.release()
        return JSONResponse({"success": True, "message": f"loaded {str(real)!r}",
                             "weight_version": version, "load_seconds": round(t1 - t0, 3),
                             "swap_seconds": round(t2 - t1, 3)})


def install_pause_routes(app: FastAPI, aengine: Any, *, auth: Any) -> None:
    """POST /admin/pause, /admin/resume, /admin/sleep and /admin/wake_up (see the module
    docstring), behind `auth`."""

    @app.post("/admin/pause", dependencies=[Depends(auth)])
    async def pause(req: PauseRequest) -> JSONResponse:
        mode = pause_mode(req.mode, "mode")
        stats = await engine_call(aengine, lambda eng: (eng.pause_generation(mode),
                                                        eng.get_stats())[1], "pause")
        return JSONResponse({"success": True, "paused": True, "mode": mode,
                             "weight_version": stats["weight_version"],
                             "num_running": stats["num_running"],
                             "num_waiting": stats["num_waiting"]})

    @app.post("/admin/resume", dependencies=[Depends(auth)])
    async def resume() -> JSONResponse:
        await engine_call(aengine, lambda eng: eng.resume_generation(), "resume")
        return JSONResponse({"success": True, "paused": False})

    @app.post("/admin/sleep", dependencies=[Depends(auth)])
    async def sleep(req: SleepRequest) -> JSONResponse:
        if pause_mode(req.mode, "mode") == "keep":
            raise APIError(400, "mode='keep': sleeping frees the KV cache, so running "
                           "requests cannot keep theirs; use 'abort', 'wait' or 'retract'",
                           param="mode")
        if req.level not in (1, 2):
            raise APIError(400, f"level={req.level}: must be 1 (free the KV cache) or 2 "
                           "(also the weights)", param="level")
        if req.discard_weights and req.level != 2:
            raise APIError(400, f"discard_weights=true needs level 2, got level={req.level}",
                           param="discard_weights")
        stats = await engine_call(aengine, lambda eng: (eng.sleep(
            req.level, mode=req.mode, reject_new=req.reject_new,
            discard_weights=req.discard_weights), eng.get_stats())[1], "sleep")
        return JSONResponse({"success": True, "is_sleeping": True, "level": req.level,
                             "kv_cache_bytes": stats.get("kv_cache_bytes"),
                             "weights_bytes": stats.get("weights_bytes")})

    @app.post("/admin/wake_up", dependencies=[Depends(auth)])
    async def wake_up(req: WakeUpRequest | None = None) -> JSONResponse:
        tags = None if req is None else req.tags
        if tags is not None and (not tags or set(tags) - set(SLEEP_TAGS)):
            raise APIError(400, f"tags={tags}: expected a non-empty subset of "
                           f"{list(SLEEP_TAGS)}", param="tags")
        stats = await engine_call(aengine, lambda eng: (eng.wake_up(tags),
                                                        eng.get_stats())[1], "wake_up")
        return JSONResponse({"success": True, "is_sleeping": stats["is_sleeping"],
                             "kv_cache_bytes": stats.get("kv_cache_bytes"),
                             "weights_bytes": stats.get("weights_bytes")})

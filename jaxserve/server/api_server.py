"""`jaxserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
POST /tokenize, POST /detokenize, POST /reset_prefix_cache (vLLM's), GET /health,
GET /metrics, and with an API key the /admin/ routes (`jaxserve.server.admin`: weights, pause, sleep). Every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}`: FastAPI's 422 validation
errors and malformed JSON become 400 naming the field, unknown routes 404,
a missing/wrong bearer key 401 (only /v1/* is protected), warming up or
shutting down 503, and an unexpected exception in a handler 500 (logged; the
engine loop is unaffected). Shutdown (SIGTERM/SIGINT or `should_exit`) first
refuses new work and aborts every in-flight request, then lets uvicorn drain
connections and stops the engine loop thread in the lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import threading
import time
from typing import Any, Sequence

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.server.admin import install_admin_routes
from jaxserve.server.lora_routes import install_lora_routes
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.engine_process import ProcessAsyncEngine
from jaxserve.server.metrics import ServerMetrics, token_bucket_stats
from jaxserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, TokenizeRequest)
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.serving_chat import ChatServing
from jaxserve.server.serving_tokens import TokenizationServing

logger = logging.getLogger("jaxserve.server")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status, headers=e.headers)


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    err = errors[0]
    raw_loc = [x for x in err.get("loc", ()) if x != "body"]
    if raw_loc and raw_loc[0] in _BODY_TAGS:  # /tokenize's body shape, not a field
        raw_loc = raw_loc[1:]
    got = err.get("input")
    got_s = repr(got) if len(repr(got)) < 80 else repr(got)[:77] + "..."
    if err.get("type") == "json_invalid" or not raw_loc:
        return APIError(400, f"malformed request body: expected a JSON object "
                        f"({err.get('msg')}; got {got_s})")
    # Drop pydantic's union-branch tags ("str", "list[int]") from the location.
    loc = [str(raw_loc[0])] + [str(x) for x in raw_loc[1:]
                               if isinstance(x, int) or (x.isidentifier() and x not in _TYPE_TAGS)]
    return APIError(400, f"{'.'.join(loc)}: {err.get('msg')} (got {got_s})", param=loc[0])


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# The tags of /tokenize's two body shapes (protocol.TokenizeRequest).
_BODY_TAGS = {"completion", "chat"}


def format_startup_banner(engine: Any, *, host: str, port: int, model_name: str,
                          stats: dict | None = None) -> str:
    """One readable block describing the running server (logged once at startup).

    Reads `engine.config` (an `EngineConfig`) and `engine.get_stats()`-style
    `stats`: model, dtype, KV capacity in blocks and tokens, token buckets,
    warm-up and compile time, and the address.
    """
    cfg = engine.config
    stats = stats or {}
    block = cfg.cache.block_size
    total = stats.get("num_total_blocks", cfg.cache.num_kv_blocks or 0)
    buckets = sorted(token_bucket_stats(stats)) or list(cfg.scheduler.token_buckets or ())
    compiles = stats.get("num_compiles", stats.get("warmup_programs", 0))
    m = cfg.model
    lines = [
        "jaxserve ready",
        f"  model            {model_name} (L={m.num_hidden_layers} E={m.hidden_size} "
        f"H={m.num_attention_heads} K={m.num_key_value_heads} V={m.vocab_size})",
        f"  dtype            {m.dtype}",
        f"  kv cache         {total} blocks x {block} tokens = {total * block} tokens",
        f"  max_model_len    {cfg.scheduler.max_model_len}",
        f"  batching         max_num_batched_tokens={cfg.scheduler.max_num_batched_tokens} "
        f"max_num_seqs={cfg.scheduler.max_num_seqs}",
        f"  token buckets    {buckets}",
        (f"  warm-up          {stats.get('warmup_seconds', 0.0):.2f} s "
         f"({compiles} programs compiled)" if stats.get("warmup_done", True) else
         f"  warm-up          {stats.get('programs_ready', 0)} of "
         f"{stats.get('warmup_programs', 0)} programs ready, the rest compile in the background"),
        f"  listening on     http://{host}:{port}/v1",
    ]
    return "\n".join(lines)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object (see the module docstring for the statuses)."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return _error_response(_validation_to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
        return _error_response(APIError(exc.status_code, msg))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error in a request handler")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                        err_type="server_error"))


def build_app(engine_or_factory: Any, *, served_model_name: str | Sequence[str] | None = None,
              api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
              max_queued_requests: int | None = None, allowed_weights_dir: str | None = None,
              params_cache_dir: str | None = None, tool_call_parser: str = "auto",
              reasoning_parser: str | None = None,
              enable_auto_tool_choice: bool = True, engine_process: bool = False) -> FastAPI:
    """Build the FastAPI app around an engine (or a zero-arg factory that builds one).

    The app's lifespan starts the engine loop thread (the factory, if given,
    runs there, while /health answers 503 "warming up") and stops it on
    shutdown. `app.state.engine` is the `AsyncEngine`, `app.state.metrics` the
    `ServerMetrics` (its own `CollectorRegistry`).

    Args:
      engine_or_factory: an `LLMEngine`-like object or a callable returning one.
      served_model_name: the name (or names; the first is reported) clients use as `model`;
        None means the engine's `model_name` attribute (else "jaxserve").
      api_key: when set, /v1/* requires `Authorization: Bearer <api_key>`.
      host, port: only used for the startup banner.
      max_queued_requests: bound on requests waiting to be scheduled; past it a new
        request gets 503 with Retry-After (None: unbounded).
      allowed_weights_dir, params_cache_dir: the admin weight-load route
        (`jaxserve.server.admin`; it exists only with an api_key).
      tool_call_parser, reasoning_parser, enable_auto_tool_choice: vLLM's chat options
        (`jaxserve.server.serving_chat.ChatServing`).
      engine_process: run the engine in its own process (`ProcessAsyncEngine`, vLLM V1's
        engine-core process); `engine_or_factory` must then be a picklable factory.

    Raises:
      ValueError: an empty served_model_name list, an unknown parser name, an engine
        object with engine_process.
      TypeError: an engine_process factory that cannot be pickled.
    """
    if served_model_name is None:
        names: list[str] = []  # resolved to engine.model_name once the engine exists
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
        if not names:
            raise ValueError("served_model_name must name at least one model (or be None)")
    holder: dict[str, Any] = {}
    aengine = (ProcessAsyncEngine if engine_process else AsyncEngine)(
        engine_or_factory, on_step=lambda s: holder["metrics"].on_step(s),
        on_finished=lambda d: holder["metrics"].on_finished(d),
        max_queued_requests=max_queued_requests)
    metrics = holder["metrics"] = ServerMetrics(lambda: {**aengine.stats, **aengine.readiness()})

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start(asyncio.get_running_loop())
        banner_task = asyncio.create_task(_log_banner_when_ready(serving, host, port))
        try:
            yield
        finally:
            banner_task.cancel()
            await asyncio.to_thread(aengine.stop)

    app = FastAPI(title="jaxserve", lifespan=lifespan)
    app.state.engine = aengine
    app.state.metrics = metrics
    serving = OpenAIServing(aengine, names)
    app.state.serving = serving
    chat = ChatServing(serving, tool_call_parser=tool_call_parser,
                       reasoning_parser=reasoning_parser,
                       enable_auto_tool_choice=enable_auto_tool_choice)

    async def check_auth(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    _install_error_handlers(app)
    install_admin_routes(app, aengine, api_key=api_key, allowed_weights_dir=allowed_weights_dir,
                         auth=check_auth, params_cache_dir=params_cache_dir)
    if api_key is not None:  # issue 27: vLLM's load / unload adapter routes, as the admin's
        install_lora_routes(app, aengine, auth=check_auth, allowed_weights_dir=allowed_weights_dir)

    @app.get("/health")
    async def health() -> Response:
        if aengine.is_ready:  # progressive warm-up: serving while the rest compile
            st = aengine.stats  # paused (issue 28): alive, requests wait for the resume
            return JSONResponse({"status": "ok", **aengine.readiness(),
                                 "paused": bool(st.get("paused")),
                                 "pause_mode": st.get("pause_mode"),
                                 "is_sleeping": bool(st.get("is_sleeping"))})
        msg = {"starting": "warming up", "failed": f"engine failed: {aengine.error}"}.get(
            aengine.state, aengine.state)
        return _error_response(APIError(503, msg))

    @app.post("/reset_prefix_cache", dependencies=[Depends(check_auth)])
    async def reset_prefix_cache() -> Response:
        """vLLM's route: drop every cached prefix block no running request holds (a
        benchmark case then starts cold); {"blocks_freed": n}."""
        n = await aengine.call(lambda eng: eng.scheduler.reset_prefix_cache())
        return JSONResponse({"blocks_freed": int(n)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models() -> Response:
        now = int(time.time())
        cfg = getattr(aengine.engine, "config", None)
        max_len = cfg.scheduler.max_model_len if cfg is not None else None
        loras = set(serving.lora_names)  # adapters name their base model as parent (vLLM)
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": now, "owned_by": "jaxserve",
             "max_model_len": max_len,
             **({"parent": serving.model_names[0]} if n in loras else {})}
            for n in serving.model_names]})

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.chat(req, raw)

    tokens = TokenizationServing(serving)

    # Outside /v1, so not behind the API key: vLLM's key also guards /v1/* only.
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        return tokens.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return tokens.detokenize(req)

    return app


async def _log_banner_when_ready(serving: OpenAIServing, host: str, port: int) -> None:
    aengine = serving.engine
    ready = await asyncio.to_thread(aengine.wait_ready)
    if ready:
        logger.info("%s", format_startup_banner(aengine.engine, host=host, port=port,
                                                model_name=serving.model_names[0],
                                                stats=aengine.stats))
    else:
        logger.error("engine failed to start: %s", aengine.error)


class JaxserveServer(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests before draining connections.

    Plain uvicorn waits for open responses to finish on shutdown; a long
    generation would hold SIGTERM for minutes. Here the engine first refuses new
    work (503) and aborts everything in flight, so every open stream ends at once
    with an error event and the drain is quick.
    """

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        aengine = getattr(getattr(app, "state", None), "engine", None)
        if aengine is not None:
            aengine.begin_shutdown()
        await super().shutdown(sockets)


def serve(engine_or_factory: Any, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
          log_level: str = "info", timeout_graceful_shutdown: float = 5.0,
          max_queued_requests: int | None = None, allowed_weights_dir: str | None = None,
          params_cache_dir: str | None = None, tool_call_parser: str = "auto",
          reasoning_parser: str | None = None, enable_auto_tool_choice: bool = True,
          engine_process: bool = False) -> None:
    """Run the server until SIGTERM/SIGINT; returns after a clean shutdown.

    Args:
      engine_or_factory: an `LLMEngine`, or a zero-arg callable building one (preferred:
        the port opens at once and answers 503 until warm-up ends).
      host, port: where to listen.
      served_model_name: the `model` name(s) clients must use (None: engine.model_name).
      api_key: optional bearer token required on /v1/*.
      log_level: uvicorn log level.
      timeout_graceful_shutdown: seconds to wait for open connections on shutdown.
      max_queued_requests: bound on waiting requests (503 + Retry-After past it).
      allowed_weights_dir: the only directory the admin weight-load route reads.
      params_cache_dir: the params cache that route's loads use (None: off).
      tool_call_parser, reasoning_parser, enable_auto_tool_choice, engine_process: see
        `build_app`.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(engine_or_factory, served_model_name=served_model_name, api_key=api_key,
                    host=host, port=port, max_queued_requests=max_queued_requests,
                    allowed_weights_dir=allowed_weights_dir, params_cache_dir=params_cache_dir,
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                    enable_auto_tool_choice=enable_auto_tool_choice,
                    engine_process=engine_process)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=timeout_graceful_shutdown)
    server = JaxserveServer(config)
    # uvicorn re-raises the captured signal after a graceful shutdown so the
    # previous handler runs; make that handler a no-op so SIGTERM exits with 0.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)

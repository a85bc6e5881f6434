"""Test helpers: run an ASGI app on 127.0.0.1 in a thread; a scripted OpenAI-like server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@contextlib.contextmanager
def serve_in_thread(app):
    """Serve `app` on a free 127.0.0.1 port; yield the base URL ('http://127.0.0.1:PORT/v1')."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        th.join(timeout=30)
        sock.close()


def scripted_app(*, fail_every: int = 3, usage: bool = True, chunk_delay_s: float = 0.005,
                 tokens_per_chunk: int = 1) -> FastAPI:
    """An OpenAI-like server whose behaviour the test knows exactly.

    The k-th request received (k = 1, 2, ...) answers HTTP 500 when
    k % fail_every == 0; otherwise it streams max_tokens tokens as
    ceil(max_tokens / tokens_per_chunk) SSE chunks of text "t" per token,
    then a usage chunk (when `usage` and the client asked for it), then [DONE].
    """
    app = FastAPI()
    state = {"n": 0, "bodies": []}
    app.state.script = state

    async def handle(req: Request, chat: bool):
        body = await req.json()
        state["n"] += 1
        state["bodies"].append(body)
        if fail_every and state["n"] % fail_every == 0:
            return JSONResponse({"error": {"message": "scripted failure", "code": 500}}, status_code=500)
        n = int(body["max_tokens"])

        async def gen():
            sent = 0
            while sent < n:
                k = min(tokens_per_chunk, n - sent)
                sent += k
                text = "t" * k
                choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                          else {"index": 0, "text": text, "finish_reason": None})
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                await asyncio.sleep(chunk_delay_s)
            last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                    else {"index": 0, "text": "", "finish_reason": "length"})
            yield f"data: {json.dumps({'choices': [last]})}\n\n"
            if usage and (body.get("stream_options") or {}).get("include_usage"):
                u = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
                yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, True)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    return app

"""LoRA admin routes (issue 27), vLLM's: POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}.

Like the weight route (`jaxserve.server.admin`) they exist only when the server has an
API key and need its bearer token, and a path is read only under
`--allowed_weights_dir` (symlinks followed; 403 naming the path and the directory
otherwise, 403 without the flag). A loaded adapter is listed by /v1/models and served
to requests whose `model` is its name. A bad adapter (rank over --max_lora_rank, wrong
shapes, an unknown target module) is a 400 naming the value and the limit; unloading
an adapter a live request uses, or loading a name already registered, is a 409.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from jaxserve.lora import LoRARequest
from jaxserve.server.admin import resolve_under
from jaxserve.server.protocol import APIError


class LoadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's fields)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's fields; lora_int_id is ignored)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def install_lora_routes(app: FastAPI, aengine: Any, *, auth: Any,
                        allowed_weights_dir: str | None) -> None:
    """Add the two routes (the caller installs them only with an API key)."""
    def ready() -> None:
        if not aengine.is_ready:
            raise APIError(503, f"engine is {aengine.state}")

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(auth)])
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> JSONResponse:
        if allowed_weights_dir is None:
            raise APIError(403, "loading adapters from disk is off: start the server with "
                           "--allowed_weights_dir", param="lora_path")
        ready()
        real = resolve_under(req.lora_path, allowed_weights_dir)

        def add(eng: Any) -> int:
            lora = eng.lora
            if req.lora_name in [r.lora_name for r in lora.list_loras()]:
                raise KeyError(req.lora_name)
            lid = lora.next_id()
            lora.add_lora(LoRARequest(req.lora_name, lid, str(real)))
            return lid

        try:
            lid = await aengine.call(add)
        except KeyError:
            raise APIError(409, f"lora_name={req.lora_name!r} is already loaded",
                           param="lora_name") from None
        except ValueError as e:
            raise APIError(400, f"lora_path={req.lora_path!r}: {e}", param="lora_path") from e
        return JSONResponse({"success": True, "lora_name": req.lora_name, "lora_int_id": lid,
                             "message": f"loaded LoRA adapter {req.lora_name!r} from "
                                        f"{str(real)!r}"})

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(auth)])
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> JSONResponse:
        ready()

        def remove(eng: Any) -> bool:
            return eng.lora.remove_lora(eng.lora.request_named(req.lora_name).lora_int_id)

        try:
            await aengine.call(remove)
        except ValueError as e:
            code = 404 if "no LoRA adapter named" in str(e) else 409
            raise APIError(code, str(e), param="lora_name") from e
        return JSONResponse({"success": True, "lora_name": req.lora_name,
                             "message": f"unloaded LoRA adapter {req.lora_name!r}"})

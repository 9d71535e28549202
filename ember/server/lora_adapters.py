"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints and bodies): serve a PEFT
adapter as a model at run time, or stop serving one. Only routed with `--allow-runtime-lora-updating`
or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM gates them.

Loading checks the adapter in the front end (its config and tensor shapes against the model, no
torch) and names it; the core reads its tensors with the first request that uses it, off its loop.
Unloading only stops the name from selecting the adapter: requests running under it finish, and the
core's copies (device slot, host cache) go as the least recently used. A name loaded again gets a new
id, so its new weights never share a slot or cached prefixes with the old ones.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from ember.frontend.async_llm import AsyncLLM
from ember.lora.request import LoRARequest
from ember.server.errors import APIError, bad_request
from ember.server.openapi import BODY_ERRORS, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine
from ember.server.protocol import LoRAAdapterRequest
from ember.server.state import get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post("/v1/load_lora_adapter", **route_docs(body=LoRAAdapterRequest, errors=BODY_ERRORS))
async def load_lora_adapter(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> PlainTextResponse:
    body = await read_body(request, LoRAAdapterRequest)
    state = get_state(request)
    if body.lora_path is None:
        raise bad_request("lora_path: required to load an adapter", "lora_path")
    if body.lora_name in state.loras or body.lora_name == state.settings.model_name:
        raise bad_request(f"lora_name: the model {body.lora_name!r} is already served", "lora_name")
    try:  # reads adapter_config.json and the safetensors header: off the event loop
        await asyncio.to_thread(engine.processor.check_lora, LoRARequest(body.lora_name, 1, body.lora_path))
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    state.add_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", **route_docs(body=LoRAAdapterRequest, errors=BODY_ERRORS))
async def unload_lora_adapter(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> PlainTextResponse:
    body = await read_body(request, LoRAAdapterRequest)
    state = get_state(request)
    if state.loras.pop(body.lora_name, None) is None:
        raise APIError(
            404, f"The LoRA adapter '{body.lora_name}' is not loaded", "not_found_error", "lora_name", "model_not_found"
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

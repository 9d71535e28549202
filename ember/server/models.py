"""GET /v1/models, POST /tokenize and POST /detokenize: what the served model is, and its tokenizer;
POST /reset_prefix_cache (vLLM's name): forget cached prefixes, e.g. between benchmark runs.

None of these runs the model; /tokenize renders chat messages through conversation.py's `render_chat`, so a
client counts exactly the tokens a chat request would send.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from ember.frontend.async_llm import AsyncLLM
from ember.multimodal.parts import split_images
from ember.server.conversation import render_chat
from ember.server.errors import bad_request
from ember.server.openapi import BODY_ERRORS, ENGINE_ERRORS, ResetPrefixCacheResponse, route_docs
from ember.server.plumbing import check_api_key, read_body, ready_engine, require_tokenizer
from ember.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    template_messages,
)
from ember.server.state import get_state

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.get("/v1/models", **route_docs(response=ModelList, errors=ENGINE_ERRORS))
async def list_models(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> ModelList:
    state = get_state(request)
    s = state.settings
    base = ModelCard(id=s.model_name, created=state.created, root=s.model_root, max_model_len=engine.max_model_len)
    adapters = [
        ModelCard(
            id=name, created=state.created, root=lora.lora_path, parent=s.model_name, max_model_len=engine.max_model_len
        )
        for name, lora in state.loras.items()
    ]
    return ModelList(data=[base, *adapters])


@router.post("/tokenize", **route_docs(body=TokenizeRequest, response=TokenizeResponse, errors=BODY_ERRORS))
async def tokenize(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> TokenizeResponse:
    body = await read_body(request, TokenizeRequest)
    tokenizer = require_tokenizer(engine)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' or 'messages'", "prompt")
    if body.messages is not None:
        messages = template_messages(body.messages)
        if split_images(messages)[1]:
            raise bad_request(
                "messages: /tokenize does not read images yet (their tokens depend on the model)", "messages"
            )
        add_special = bool(body.add_special_tokens)
        rendered = await asyncio.to_thread(
            render_chat, tokenizer, messages, body.add_generation_prompt, add_special, None, TokenizeRequest
        )
        ids = rendered["prompt_token_ids"]
    else:
        assert body.prompt is not None  # exactly one of prompt and messages, checked above
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)


@router.post("/detokenize", **route_docs(body=DetokenizeRequest, response=DetokenizeResponse, errors=BODY_ERRORS))
async def detokenize(request: Request, engine: AsyncLLM = Depends(ready_engine)) -> DetokenizeResponse:
    body = await read_body(request, DetokenizeRequest)
    tokenizer = require_tokenizer(engine)
    vocab = engine.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"tokens[{i}]: {t} is not a token id of this model (0 to {vocab - 1})", f"tokens[{i}]")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.post("/reset_prefix_cache", **route_docs(response=ResetPrefixCacheResponse, errors=ENGINE_ERRORS))
async def reset_prefix_cache(engine: AsyncLLM = Depends(ready_engine)) -> dict[str, bool]:
    """`reset` is false while requests hold KV blocks: the cache is then left as it is."""
    return {"reset": await engine.reset_prefix_cache()}

"""The probes other routers send an engine server before they route to it.

sglang-router (0.3) asks a worker ``GET /health``, ``/server_info`` and ``/model_info``
(older releases ``/get_server_info`` and ``/get_model_info``) when it registers it; a 404 there
is a worker it cannot describe. kvgate answers them with what it knows of its model, in the
fields SGLang's own server uses for them: ``model_path`` (the served model's id),
``is_generation``, ``max_total_num_tokens`` (the KV cache in tokens) and the context length.
No ``tokenizer_path``: the router then routes on text, as it does for any OpenAI backend.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.gateway.catalog.catalog import ModelFacts

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")


def probe_routes(facts: ModelFacts, model: str) -> list[Route]:
    """``/server_info`` and ``/model_info`` (and their ``get_`` twins) for ``model``."""
    model_info = {
        "model_path": model,
        "served_model_name": model,
        "is_generation": True,
        "max_model_len": facts.max_model_len,
    }
    server_info = {
        **model_info,
        "context_length": facts.max_model_len,
        "max_total_num_tokens": facts.block_size * facts.num_blocks,
        "page_size": facts.block_size,
    }

    async def model_answer(request: Request) -> Response:
        return JSONResponse(model_info)

    async def server_answer(request: Request) -> Response:
        return JSONResponse(server_info)

    return [
        *(Route(path, model_answer) for path in MODEL_INFO_PATHS),
        *(Route(path, server_answer) for path in SERVER_INFO_PATHS),
    ]

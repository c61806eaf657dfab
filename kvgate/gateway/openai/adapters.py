"""vLLM's LoRA routes on the OpenAI door: the adapters' cards in ``/v1/models``, and the
runtime ``/v1/load_lora_adapter`` (``{"lora_name", "lora_path", "load_inplace"}``) and
``/v1/unload_lora_adapter`` (``{"lora_name"}``), answered as vLLM answers them: 200 with a
plain-text ``Success: …`` line, 400 for a body without the names, 404 for a path with no
adapter or a name not loaded. An adapter vLLM would answer with a 500 (a rank over
``--max-lora-rank``, a tensor that does not fit the base model) is a 400 here naming the
file and tensor: the caller's folder is at fault, not the server.
"""

from __future__ import annotations

from typing import Any

from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.calls.generations import Generations
from kvgate.gateway.generation import Adapter


def cards(
    adapters: list[Adapter] | None, base: str, created: int, max_model_len: int
) -> list[dict[str, Any]]:
    """``/v1/models`` entries for the adapters (vLLM's: ``root`` the folder, ``parent`` the
    base model)."""
    return [
        {
            "id": adapter.name,
            "object": "model",
            "created": created,
            "owned_by": "kvgate",
            "root": adapter.path,
            "parent": base,
            "max_model_len": max_model_len,
        }
        for adapter in adapters or []
    ]


async def load(generations: Generations, body: dict[str, Any], base: str) -> str:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise BadInput("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if name == base:
        raise BadInput(f"'{name}' is the base model's name", "lora_name")
    replace = body.get("load_inplace", False)
    if not isinstance(replace, bool):
        raise BadInput("'load_inplace' must be a boolean", "load_inplace")
    await generations.load_adapter(name, path, replace)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload(generations: Generations, body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not (isinstance(name, str) and name):
        raise BadInput("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    await generations.unload_adapter(name)
    return f"Success: LoRA adapter '{name}' removed successfully."

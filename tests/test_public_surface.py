"""Each package's public surface is pinned: what ``__all__`` names is exactly what it
exports (no accidental public names, nothing listed that is missing), as httpx tests its own."""

from __future__ import annotations

import importlib
import types

import pytest

SURFACES = {
    "kvgate.engine": [
        "LLM",
        "AdmissionRefused",
        "AsyncLLM",
        "EmbeddingOutput",
        "EngineConfig",
        "EngineOverloaded",
        "EngineStats",
        "EngineStepError",
        "EngineUnavailable",
        "OutputKind",
        "ReplicaStats",
        "RequestOptions",
        "RequestOutput",
        "RequestStream",
        "SamplingParams",
        "StructuredOutputs",
    ],
    "kvgate.engine.attention": [
        "BACKEND_NAMES",
        "FP8_DTYPE",
        "AttentionBackend",
        "AttentionMetadata",
        "KVCache",
        "allocate_kv_caches",
        "cache_scheme",
        "get_attention_backend",
        "kv_bytes_per_token",
        "paged_attention",
        "resolve_cache_dtype",
        "write_kv",
    ],
    "kvgate.protocol": [
        "SUPPORTED_VERSIONS",
        "Era",
        "Message",
        "ProtocolError",
        "RequestId",
        "encode_error",
        "encode_result",
        "era_of",
        "parse_message",
        "splice_result",
    ],
    "kvgate.schemas": ["ArgumentValidator", "inference_tools"],
    "kvgate.gateway": ["Settings", "create_app"],
}


@pytest.mark.parametrize("name", sorted(SURFACES))
def test_all_is_pinned_and_matches_what_the_package_exports(name: str) -> None:
    package = importlib.import_module(name)
    assert sorted(package.__all__) == sorted(SURFACES[name])
    for member in package.__all__:
        assert hasattr(package, member), f"{name}.__all__ names {member}, which is missing"
    public = {
        key
        for key, value in vars(package).items()
        if not key.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(package.__all__), f"{name} exports names outside __all__"


def test_the_version_is_the_distributions() -> None:
    import importlib.metadata

    import kvgate

    assert kvgate.__version__ == importlib.metadata.version("kvgate")
    assert kvgate.__version__.count(".") >= 2

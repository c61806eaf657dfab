import orjson
import pytest

from kvgate.gateway.catalog.catalog import Catalog, ModelFacts
from kvgate.protocol.errors import INVALID_PARAMS, ProtocolError
from kvgate.schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, RESULT_TYPES, validator

FACTS = ModelFacts("tiny", 4096, 16, 1024, "float32", 2)
LISTS = [
    "server/discover",
    "tools/list",
    "resources/list",
    "resources/templates/list",
    "prompts/list",
]


@pytest.mark.parametrize("method", LISTS)
def test_results_are_valid_and_cacheable(method: str) -> None:
    result = orjson.loads(Catalog(FACTS).result_bytes(method, {}))
    validator(MODERN_WIRE, RESULT_TYPES[method]).validate(result)
    if method != "server/discover":  # legacy clients get the same bytes
        validator(LEGACY_WIRE, RESULT_TYPES[method]).validate(result)
    assert result["ttlMs"] == 3_600_000 and result["cacheScope"] == "public"


def test_version_is_a_content_hash() -> None:
    assert Catalog(FACTS).version == Catalog(FACTS).version
    assert (
        Catalog(FACTS).version != Catalog(ModelFacts("tiny", 2048, 16, 1024, "float32", 2)).version
    )
    assert Catalog(FACTS).version != Catalog(FACTS, instructions="other").version


def test_bytes_are_built_once() -> None:
    catalog = Catalog(FACTS)
    assert catalog.result_bytes("tools/list", {}) is catalog.result_bytes("tools/list", {})


def test_model_resource() -> None:
    catalog = Catalog(FACTS)
    uri = orjson.loads(catalog.result_bytes("resources/list", {}))["resources"][0]["uri"]
    contents = orjson.loads(catalog.result_bytes("resources/read", {"uri": uri}))["contents"]
    assert orjson.loads(contents[0]["text"]) == FACTS.as_dict()
    with pytest.raises(ProtocolError) as caught:
        catalog.result_bytes("resources/read", {"uri": "kvgate://models/other"})
    assert caught.value.code == INVALID_PARAMS and caught.value.data == {
        "uri": "kvgate://models/other"
    }


def test_prompt() -> None:
    catalog = Catalog(FACTS)
    result = catalog.get_prompt("summarize", {"text": "abc"})
    validator(MODERN_WIRE, "GetPromptResult").validate({"resultType": "complete", **result})
    for name, arguments in (("other", {}), ("summarize", {}), ("summarize", {"text": 1})):
        with pytest.raises(ProtocolError):
            catalog.get_prompt(name, arguments)

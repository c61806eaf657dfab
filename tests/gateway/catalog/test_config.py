"""The operator catalog config: what a valid file yields, and one clear refusal per mistake."""

from __future__ import annotations

import json

import orjson
import pytest

from kvgate.gateway.catalog.catalog import Catalog, ModelFacts
from kvgate.gateway.catalog.config import (
    CatalogConfigError,
    load_catalog_config,
    parse_catalog_config,
)
from kvgate.protocol.errors import INVALID_PARAMS, ProtocolError
from kvgate.schemas.mcp_wire import MODERN_WIRE, RESULT_TYPES, validator

FACTS = ModelFacts("tiny", 4096, 16, 1024, "float32", 2)
CONFIG = {
    "instructions": "Be brief.",
    "resources": [
        {
            "uri": "docs://usage",
            "name": "usage",
            "text": "# Usage\n...",
            "mimeType": "text/markdown",
            "description": "How to call kvgate.",
        }
    ],
    "prompts": [
        {
            "name": "translate",
            "description": "Translate a text.",
            "template": "Translate into $language:\n\n$text",
            "arguments": [{"name": "text", "required": True}, {"name": "language"}],
        }
    ],
}


def test_a_config_adds_resources_and_prompts_to_the_catalog() -> None:
    catalog = Catalog(FACTS, config=parse_catalog_config(CONFIG))
    resources = orjson.loads(catalog.result_bytes("resources/list", {}))
    prompts = orjson.loads(catalog.result_bytes("prompts/list", {}))
    for method, result in (("resources/list", resources), ("prompts/list", prompts)):
        validator(MODERN_WIRE, RESULT_TYPES[method]).validate(result)
    assert resources["resources"][1] == {
        k: v for k, v in CONFIG["resources"][0].items() if k != "text"
    }
    assert [p["name"] for p in prompts["prompts"]] == ["summarize", "translate"]
    read = orjson.loads(catalog.result_bytes("resources/read", {"uri": "docs://usage"}))
    assert read["contents"] == [
        {"uri": "docs://usage", "mimeType": "text/markdown", "text": "# Usage\n..."}
    ]
    got = catalog.get_prompt("translate", {"text": "Hallo", "language": "French"})
    assert got["messages"][0]["content"]["text"] == "Translate into French:\n\nHallo"
    assert got["description"] == "Translate a text."
    with pytest.raises(ProtocolError) as caught:
        catalog.get_prompt("translate", {"language": "French"})
    assert caught.value.code == INVALID_PARAMS


def test_the_version_follows_every_part_of_the_config() -> None:
    base = Catalog(FACTS, config=parse_catalog_config(CONFIG)).version
    assert (
        base == Catalog(FACTS, config=parse_catalog_config(json.loads(json.dumps(CONFIG)))).version
    )
    template_only = {
        **CONFIG,
        "prompts": [{**CONFIG["prompts"][0], "template": "To $language: $text"}],
    }
    text_only = {**CONFIG, "resources": [{**CONFIG["resources"][0], "text": "other"}]}
    for changed in (template_only, text_only, {**CONFIG, "instructions": "Be long."}):
        assert Catalog(FACTS, config=parse_catalog_config(changed)).version != base


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"instructions": 3}, "instructions: 3 is not of type 'string'"),
        ({"colour": "red"}, "Additional properties are not allowed"),
        ({"resources": [{"uri": "no-scheme", "name": "x", "text": ""}]}, "resources/0/uri"),
        ({"prompts": [{"name": "p", "template": "Hi $who"}]}, "undeclared argument(s) ['who']"),
        ({"prompts": [{"name": "p", "template": "Hi $"}]}, "bad $placeholder"),
        ({"resources": [CONFIG["resources"][0]] * 2}, "a resource uri appears twice"),
    ],
)
def test_mistakes_are_refused_with_their_place(config: dict, says: str) -> None:
    with pytest.raises(CatalogConfigError, match=None) as caught:
        parse_catalog_config(config)
    assert says in str(caught.value)


def test_clashes_with_built_in_entries_are_refused() -> None:
    model_uri = {"resources": [{"uri": "kvgate://models/tiny", "name": "m", "text": ""}]}
    summarize = {"prompts": [{"name": "summarize", "template": "x"}]}
    for config in (model_uri, summarize):
        with pytest.raises(CatalogConfigError, match="already served"):
            Catalog(FACTS, config=parse_catalog_config(config))


def test_files_that_cannot_be_read(tmp_path) -> None:
    with pytest.raises(CatalogConfigError, match="missing.json"):
        load_catalog_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(CatalogConfigError, match="broken.json"):
        load_catalog_config(broken)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(CONFIG))
    assert load_catalog_config(good) == parse_catalog_config(CONFIG)


def test_the_kubernetes_example_catalog_is_valid() -> None:
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    manifest = Path(__file__).resolve().parents[3] / "examples/deploy/k8s/kvgate.yaml"
    config_map = next(
        d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "ConfigMap"
    )
    config = parse_catalog_config(json.loads(config_map["data"]["catalog.json"]))
    assert Catalog(FACTS, config=config).get_prompt("translate", {"text": "a", "language": "b"})

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import HEADER_MISMATCH, INVALID_PARAMS, ProtocolError
from kvgate.protocol.jsonrpc_types import Message
from kvgate.protocol.modern import (
    CLIENT_CAPABILITIES_KEY,
    PROTOCOL_VERSION_KEY,
    check_legacy_meta,
    check_modern_request,
)

META = {PROTOCOL_VERSION_KEY: "2026-07-28", CLIENT_CAPABILITIES_KEY: {"elicitation": {}}}
HEADERS = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "generate"}


def message(meta: object = META, **params: object) -> Message:
    return Message("tools/call", {"name": "generate", "_meta": meta, **params}, id=1)


def test_valid_request_reports_its_envelope() -> None:
    request = check_modern_request(message(), HEADERS)
    assert request.protocol_version == "2026-07-28"
    assert request.client_capabilities == {"elicitation": {}}


@pytest.mark.parametrize(
    "meta",
    [
        None,
        "x",
        {CLIENT_CAPABILITIES_KEY: {}},
        {PROTOCOL_VERSION_KEY: "2026-07-28"},
        {PROTOCOL_VERSION_KEY: "2026-07-28", CLIENT_CAPABILITIES_KEY: []},
    ],
)
def test_missing_envelope_fields_are_invalid_params(meta: object) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_modern_request(message(meta), HEADERS)
    assert caught.value.code == INVALID_PARAMS
    assert caught.value.http_status(modern=True) == 400


@pytest.mark.parametrize(
    "headers",
    [
        {**HEADERS, "mcp-protocol-version": "2025-11-25"},
        {k: v for k, v in HEADERS.items() if k != "mcp-method"},
        {**HEADERS, "mcp-method": "tools/list"},
        {k: v for k, v in HEADERS.items() if k != "mcp-name"},
        {**HEADERS, "mcp-name": "chat"},
        {**HEADERS, "mcp-name": "=?base64?Y2hhdA==?="},
    ],
)
def test_headers_must_mirror_the_body(headers: dict) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_modern_request(message(), headers)
    assert caught.value.code == HEADER_MISMATCH


def test_encoded_name_is_decoded_before_comparison() -> None:
    check_modern_request(message(), {**HEADERS, "mcp-name": "=?base64?Z2VuZXJhdGU=?="})


def test_modern_meta_under_a_legacy_header_is_a_mismatch() -> None:
    check_legacy_meta(Message("tools/list", {}, id=1), None)
    check_legacy_meta(
        Message("tools/list", {"_meta": {PROTOCOL_VERSION_KEY: "2025-11-25"}}, id=1), "2025-11-25"
    )
    with pytest.raises(ProtocolError) as caught:
        check_legacy_meta(message(), None)
    assert caught.value.code == HEADER_MISMATCH


@settings(max_examples=300, deadline=None)
@given(
    meta=st.dictionaries(
        st.sampled_from([PROTOCOL_VERSION_KEY, CLIENT_CAPABILITIES_KEY, "x"]),
        st.none() | st.text() | st.dictionaries(st.text(), st.text()),
    ),
    headers=st.dictionaries(st.sampled_from(list(HEADERS)), st.text()),
    name=st.none() | st.text() | st.integers(),
)
def test_any_envelope_passes_or_raises_a_protocol_error(
    meta: dict, headers: dict, name: object
) -> None:
    try:
        check_modern_request(Message("tools/call", {"name": name, "_meta": meta}, id=1), headers)
    except ProtocolError as error:
        assert error.code in (INVALID_PARAMS, HEADER_MISMATCH)

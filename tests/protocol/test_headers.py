import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import HEADER_MISMATCH, ProtocolError
from kvgate.protocol.headers import (
    HeaderParam,
    check_param_headers,
    decode_header_value,
    encode_header_value,
    header_params,
)

# The spec's own encoding table (Streamable HTTP, "Value Encoding").
SPEC_EXAMPLES = [
    ("us-west1", "us-west1"),
    ("Hello, 世界", "=?base64?SGVsbG8sIOS4lueVjA==?="),
    (" padded ", "=?base64?IHBhZGRlZCA=?="),
    ("line1\nline2", "=?base64?bGluZTEKbGluZTI=?="),
    ("=?base64?literal?=", "=?base64?PT9iYXNlNjQ/bGl0ZXJhbD89?="),
]


@pytest.mark.parametrize(("value", "header"), SPEC_EXAMPLES)
def test_spec_encoding_table(value: str, header: str) -> None:
    assert encode_header_value(value) == header
    assert decode_header_value(header) == value


@pytest.mark.parametrize(
    "raw", ["=?base64?not base64!?=", "=?base64?/w==?=", "=?base64?\u00e9?=", "caf\u00e9", "a\x01b"]
)
def test_undecodable_or_unsafe_values_are_header_mismatch(raw: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_header_value(raw)
    assert caught.value.code == HEADER_MISMATCH


SCHEMA = {
    "type": "object",
    "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "n": {"type": "integer", "x-mcp-header": "N"},
        "flag": {"type": "boolean", "x-mcp-header": "Flag"},
        "nested": {
            "type": "object",
            "properties": {"key": {"type": "string", "x-mcp-header": "Key"}},
        },
        "plain": {"type": "string"},
        "list": {"type": "array", "items": {"type": "string"}},
    },
}


def test_header_params_follow_properties_chains() -> None:
    found = {p.header: p for p in header_params(SCHEMA)}
    assert found["Key"] == HeaderParam(("nested", "key"), "Key", "string")
    assert set(found) == {"Region", "N", "Flag", "Key"}


@pytest.mark.parametrize(
    "bad",
    [
        {"properties": {"a": {"type": "number", "x-mcp-header": "A"}}},
        {"properties": {"a": {"type": "string", "x-mcp-header": "A B"}}},
        {
            "properties": {
                "a": {"type": "string", "x-mcp-header": "X"},
                "b": {"type": "string", "x-mcp-header": "x"},
            }
        },
    ],
)
def test_forbidden_annotations_fail_early(bad: dict) -> None:
    with pytest.raises(ValueError):
        header_params(bad)


PARAMS = header_params(SCHEMA)


@pytest.mark.parametrize(
    ("arguments", "headers"),
    [
        ({}, {}),
        ({"region": None}, {}),
        ({"region": "us-west1"}, {"mcp-param-region": "us-west1"}),
        ({"region": "Hello, 世界"}, {"mcp-param-region": "=?base64?SGVsbG8sIOS4lueVjA==?="}),
        ({"n": 42}, {"mcp-param-n": "42"}),
        ({"n": 42}, {"mcp-param-n": "42.0"}),
        ({"flag": False}, {"mcp-param-flag": "false"}),
        ({"nested": {"key": "k"}}, {"mcp-param-key": "k"}),
    ],
)
def test_matching_headers_pass(arguments: dict, headers: dict) -> None:
    check_param_headers(PARAMS, arguments, headers)


@pytest.mark.parametrize(
    ("arguments", "headers"),
    [
        ({"region": "us-west1"}, {}),
        ({"region": "us-west1"}, {"mcp-param-region": "eu-west1"}),
        ({"n": 42}, {"mcp-param-n": "42.5"}),
        ({"n": 42}, {"mcp-param-n": "4e1"}),
        ({"flag": True}, {"mcp-param-flag": "True"}),
        ({"nested": {"key": "k"}}, {"mcp-param-key": "=?base64?bm8=?="}),
        ({}, {"mcp-param-region": "bad\x7f"}),
    ],
)
def test_missing_or_different_headers_are_rejected(arguments: dict, headers: dict) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_param_headers(PARAMS, arguments, headers)
    assert caught.value.code == HEADER_MISMATCH


# -- fuzzing --------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_survives_the_header_round_trip(value: str) -> None:
    header = encode_header_value(value)
    assert header.isascii() and decode_header_value(header) == value


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=").map(
            lambda s: f"=?base64?{s}?="
        ),
        st.binary().map(lambda b: b.decode("latin-1")),
    )
)
def test_any_header_value_decodes_or_is_a_header_mismatch(raw: str) -> None:
    try:
        decoded = decode_header_value(raw)
    except ProtocolError as error:
        assert error.code == HEADER_MISMATCH
    else:
        assert isinstance(decoded, str)


@settings(max_examples=300, deadline=None)
@given(
    arguments=st.dictionaries(
        st.sampled_from(["region", "n", "flag", "nested", "plain"]),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text()
        | st.dictionaries(st.just("key"), st.text() | st.integers()),
    ),
    headers=st.dictionaries(
        st.sampled_from(
            [
                "mcp-param-region",
                "mcp-param-n",
                "mcp-param-flag",
                "mcp-param-key",
                "mcp-param-other",
            ]
        ),
        st.text(),
    ),
)
def test_any_arguments_and_headers_pass_or_are_a_header_mismatch(
    arguments: dict, headers: dict
) -> None:
    try:
        check_param_headers(header_params(SCHEMA), arguments, headers)
    except ProtocolError as error:
        assert error.code == HEADER_MISMATCH

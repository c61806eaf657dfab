import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import INVALID_REQUEST, PARSE_ERROR, ProtocolError
from kvgate.protocol.jsonrpc import encode_error, encode_result, parse_message, splice_result


def test_request_and_notification() -> None:
    request = parse_message(b'{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"a":1}}')
    assert (request.id, request.method, request.params) == (7, "tools/list", {"a": 1})
    assert not request.is_notification
    note = parse_message(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
    assert note.is_notification and note.params == {}


@pytest.mark.parametrize(
    ("body", "code", "request_id"),
    [
        (b"{not json", PARSE_ERROR, None),
        (b"", PARSE_ERROR, None),
        (b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', INVALID_REQUEST, None),
        (b'"ping"', INVALID_REQUEST, None),
        (b'{"jsonrpc":"1.0","id":3,"method":"ping"}', INVALID_REQUEST, 3),
        (b'{"jsonrpc":"2.0","id":"x","method":5}', INVALID_REQUEST, "x"),
        (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":4,"method":"ping","params":[1]}', INVALID_REQUEST, 4),
        (b'{"jsonrpc":"2.0","id":5,"result":{}}', INVALID_REQUEST, 5),
    ],
)
def test_bad_messages(body: bytes, code: int, request_id: object) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_message(body)
    assert caught.value.code == code
    assert caught.value.request_id == request_id


def test_splice_equals_encode() -> None:
    result = {"tools": [{"name": "é"}], "ttlMs": 5}
    for request_id in (1, "abc", -3):
        spliced = splice_result(request_id, orjson.dumps(result))
        assert orjson.loads(spliced) == orjson.loads(encode_result(request_id, result))


def test_error_without_id_omits_it() -> None:
    error = ProtocolError(PARSE_ERROR, "Parse error", data={"at": 1})
    assert orjson.loads(encode_error(error)) == {
        "jsonrpc": "2.0",
        "error": {"code": PARSE_ERROR, "message": "Parse error", "data": {"at": 1}},
    }
    error.request_id = 9
    assert orjson.loads(encode_error(error))["id"] == 9


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary()))
def test_any_body_parses_or_raises_a_protocol_error(body: bytes) -> None:
    try:
        message = parse_message(body)
    except ProtocolError as error:
        assert error.code in (PARSE_ERROR, INVALID_REQUEST)
    else:
        assert isinstance(message.method, str) and isinstance(message.params, dict)


# -- fuzzing: every input gets its own error, never an unhandled exception ------------------

request_ids = st.text(max_size=20) | st.integers(min_value=-(2**63), max_value=2**63 - 1)
wire_values = st.recursive(  # what orjson round-trips exactly (no infinities, 64-bit ints)
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
huge_numbers = st.sampled_from(
    [
        b"1" * 400,
        b"-" + b"9" * 40,
        b"1e400",
        b"-1e-400",
        b"1.5e308",
        b"18446744073709551616",
        b"0.0000000000000000000001",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    request_id=request_ids,
    method=st.text(min_size=1),
    params=st.dictionaries(st.text(), wire_values),
)
def test_a_well_formed_request_keeps_its_id_method_and_params(
    request_id: str | int, method: str, params: dict
) -> None:
    body = orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
    message = parse_message(body)
    assert (message.id, message.method, message.params) == (request_id, method, params)


@settings(max_examples=200, deadline=None)
@given(wire_values.filter(lambda v: not isinstance(v, dict)))
def test_any_json_that_is_not_an_object_is_an_invalid_request(value: object) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_message(json.dumps(value).encode())
    assert caught.value.code == INVALID_REQUEST


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1).filter(lambda b: not _decodes(b)))
def test_invalid_utf8_is_a_parse_error(body: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_message(b'{"jsonrpc":"2.0","id":1,"method":"' + body + b'"}')
    assert caught.value.code == PARSE_ERROR


@settings(max_examples=100, deadline=None)
@given(number=huge_numbers, where=st.sampled_from(["id", "params"]))
def test_huge_numbers_parse_or_are_refused_cleanly(number: bytes, where: str) -> None:
    if where == "id":
        body = b'{"jsonrpc":"2.0","id":' + number + b',"method":"ping"}'
    else:
        body = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"n":' + number + b"}}"
    try:
        message = parse_message(body)
    except ProtocolError as error:  # orjson refuses what does not fit; a float id is no id
        assert error.code in (PARSE_ERROR, INVALID_REQUEST)
    else:
        assert message.method == "ping"


@settings(max_examples=100, deadline=None)
@given(
    depth=st.integers(min_value=1, max_value=3000),
    limit=st.integers(min_value=2, max_value=128),
    kind=st.sampled_from(["[", "{"]),
)
def test_nesting_past_the_limit_is_an_invalid_request(depth: int, limit: int, kind: str) -> None:
    inner = ("[" * depth + "]" * depth) if kind == "[" else ('{"a":' * depth + "1" + "}" * depth)
    body = f'{{"jsonrpc":"2.0","id":1,"method":"m","params":{{"x":{inner}}}}}'.encode()
    total = depth + 2  # the request and its params are two levels
    try:
        parse_message(body, max_depth=limit)
    except ProtocolError as error:
        assert error.code == INVALID_REQUEST and total > limit and "deeper" in error.message
    else:
        assert total <= limit


def _decodes(data: bytes) -> bool:
    """Valid UTF-8 (``b"\\r"`` is, and inside a JSON string it is an escape, not an error)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

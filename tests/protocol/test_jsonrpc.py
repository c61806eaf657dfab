import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import INVALID_REQUEST, PARSE_ERROR, ProtocolError
from protocol.jsonrpc import encode_error, encode_result, parse_message, splice_result


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
        "jsonrpc": "2.0", "error": {"code": PARSE_ERROR, "message": "Parse error", "data": {"at": 1}},
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

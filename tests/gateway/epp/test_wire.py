"""kvgate's ext_proc v3 messages (``kvgate.gateway.epp.wire``) against Envoy's.

The wire depends on field numbers and types only. Where Envoy's generated modules happen to be
installed (``xds-protos``, not a kvgate dependency), every message, field and enum value
declared here is checked against them; the byte-level checks below need nothing but protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from kvgate.gateway.epp import messages, wire
from kvgate.gateway.epp.picker import Refusal


def _messages(descriptor: Descriptor) -> Iterator[Descriptor]:
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def _declared() -> Iterator[Descriptor]:
    for proto in wire.FILES:
        for descriptor in wire.POOL.FindFileByName(proto.name).message_types_by_name.values():
            yield from _messages(descriptor)


def _enums() -> Iterator[EnumDescriptor]:
    for proto in wire.FILES:
        file = wire.POOL.FindFileByName(proto.name)
        yield from file.enum_types_by_name.values()
    for descriptor in _declared():
        yield from descriptor.enum_types


def _shape(field: FieldDescriptor) -> tuple[Any, ...]:
    kind = field.message_type or field.enum_type
    oneof = field.containing_oneof
    return (
        field.number,
        field.type,
        field.is_repeated,
        kind.full_name if kind is not None else None,
        oneof.name if oneof is not None else None,
    )


@pytest.fixture(scope="module")
def envoy() -> Any:
    """The default pool with Envoy's own generated modules loaded (skipped where absent)."""
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
    from google.protobuf import descriptor_pool

    for module in (
        "envoy.config.core.v3.base_pb2",
        "envoy.type.v3.http_status_pb2",
        "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
    ):
        pytest.importorskip(module)
    return descriptor_pool.Default()


def test_fields_match_envoy(envoy: Any) -> None:
    checked = 0
    for ours in _declared():
        theirs = envoy.FindMessageTypeByName(ours.full_name)
        assert ours.GetOptions().map_entry == theirs.GetOptions().map_entry, ours.full_name
        for field in ours.fields:
            published = theirs.fields_by_name[field.name]
            assert _shape(field) == _shape(published), field.full_name
            checked += 1
    assert checked > 40


def test_enums_match_envoy(envoy: Any) -> None:
    for ours in _enums():
        theirs = envoy.FindEnumTypeByName(ours.full_name)
        published = {value.name: value.number for value in theirs.values}
        for value in ours.values:
            assert published[value.name] == value.number, f"{ours.full_name}.{value.name}"


def test_method_matches_envoy(envoy: Any) -> None:
    service = envoy.FindServiceByName(wire.SERVICE)
    method = service.methods_by_name["Process"]
    assert method.input_type.full_name == wire.ProcessingRequest.DESCRIPTOR.full_name
    assert method.output_type.full_name == wire.ProcessingResponse.DESCRIPTOR.full_name
    assert (method.client_streaming, method.server_streaming) == (True, True)
    assert wire.PROCESS == f"/{service.full_name}/{method.name}"


def test_envoy_parses_our_answers(envoy: Any) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    for answer in (
        messages.routed_headers("10.0.0.5:8000"),
        messages.streamed_body(b'{"model": "m"}'),
        messages.refused(Refusal(503, "no member")),
    ):
        parsed = ext.ProcessingResponse.FromString(answer.SerializeToString())
        # every byte understood: nothing Envoy's descriptors leave unknown, at any depth
        text = text_format.MessageToString(parsed, print_unknown_fields=True)
        assert text == text_format.MessageToString(parsed)
        assert text == text_format.MessageToString(answer)


# -- without Envoy's modules: the bytes themselves --------------------------------------------


def test_request_bytes_by_hand() -> None:
    """A body phase: ProcessingRequest.request_body (4) = HttpBody{body (1), end_of_stream (2)}."""
    body = wire.HttpBody(body=b"hi", end_of_stream=True)
    data = wire.ProcessingRequest(request_body=body).SerializeToString()
    assert data == b"\x22\x06\x0a\x02hi\x10\x01"
    parsed = wire.ProcessingRequest.FromString(data)
    assert parsed.WhichOneof("request") == "request_body"
    assert (parsed.request_body.body, parsed.request_body.end_of_stream) == (b"hi", True)


def test_mode_and_status_numbers() -> None:
    config = wire.ProtocolConfiguration(request_body_mode=wire.ProcessingMode.FULL_DUPLEX_STREAMED)
    # protocol_config (11) = {request_body_mode (1): FULL_DUPLEX_STREAMED = 4}
    assert wire.ProcessingRequest(protocol_config=config).SerializeToString() == b"\x5a\x02\x08\x04"
    answer = wire.ImmediateResponse(status=wire.HttpStatus(code=429))
    # immediate_response (7) = {status (1) = {code (1): 429}}
    data = wire.ProcessingResponse(immediate_response=answer).SerializeToString()
    assert data == b"\x3a\x05\x0a\x03\x08\xad\x03"
    assert wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD == 2


def test_unknown_fields_are_kept() -> None:
    """What Envoy sends beyond the declared fields (here observability_mode, 10, and
    attributes, 9) parses, and is given back unchanged if re-sent."""
    known = wire.ProcessingRequest(request_body=wire.HttpBody(body=b"x")).SerializeToString()
    data = known + b"\x50\x01" + b"\x4a\x03\x0a\x01k"
    parsed = wire.ProcessingRequest.FromString(data)
    assert parsed.request_body.body == b"x"
    assert parsed.SerializeToString() == data


def test_answers_parse_back() -> None:
    routed = messages.routed_headers("10.0.0.5:8000")
    parsed = wire.ProcessingResponse.FromString(routed.SerializeToString())
    assert parsed == routed
    [option] = parsed.request_headers.response.header_mutation.set_headers
    assert (option.header.key, option.header.raw_value) == (messages.DESTINATION, b"10.0.0.5:8000")
    assert option.append_action == wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    namespace = parsed.dynamic_metadata.fields[messages.METADATA_NAMESPACE].struct_value
    assert namespace.fields[messages.DESTINATION].string_value == "10.0.0.5:8000"

    refused = messages.refused(Refusal(413, "too large"))
    parsed = wire.ProcessingResponse.FromString(refused.SerializeToString())
    assert parsed.immediate_response.status.code == 413
    assert parsed.immediate_response.body == b"too large"
    assert parsed.immediate_response.details == "kvgate_epp_413"


def test_subset_hint_from_metadata() -> None:
    metadata = wire.Metadata()
    hint = metadata.filter_metadata[messages.SUBSET_NAMESPACE]
    hint.get_or_create_list(messages.SUBSET_KEY).extend(["10.0.0.5:8000", "10.0.0.6:8000"])
    request = wire.ProcessingRequest(metadata_context=metadata)
    parsed = wire.ProcessingRequest.FromString(request.SerializeToString())
    assert messages.subset_hint(parsed) == ["10.0.0.5:8000", "10.0.0.6:8000"]
    assert messages.subset_hint(wire.ProcessingRequest()) is None

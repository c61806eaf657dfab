"""Envoy's ext_proc v3 messages, declared here: the subset kvgate epp speaks, nothing else.

Why not Envoy's generated modules: the one package that ships them for Python
(``xds-protos``) also ships its own copies of ``opentelemetry/proto/...`` and
``google/api/...``, which overwrite the files of ``opentelemetry-proto`` and
``googleapis-common-protos`` when it is installed after them (and are overwritten when it is
installed before). Which versions a venv ends up with depends on install order, and the
OpenTelemetry extra breaks on the wrong one. A dependency that overwrites another's files
cannot ship, so the messages are built here from a ``FileDescriptorProto`` made in code (no
``protoc``, no generated sources).

Protobuf's wire format knows a field by its number and type alone, so what Envoy sends and
reads depends on exactly three things, all copied from Envoy's ``.proto`` files: the package
and message names (for the gRPC method's path and nothing else on the wire), the field
numbers, and the field types. Only the fields kvgate reads or writes are declared; whatever
else Envoy sends arrives as unknown fields, which protobuf keeps and kvgate ignores.
``tests/gateway/epp/test_wire.py`` checks every number here against Envoy's published
descriptors where those are installed.

The descriptors live in a pool of their own, not protobuf's default one: a process that also
loads Envoy's generated modules (another library, or the check above) would otherwise meet
the same message names twice and fail at import. ``Struct`` (dynamic metadata, filter
metadata) is protobuf's well-known type, added to that pool from the descriptor protobuf
ships; build metadata with ``wire.Struct``, the class this pool's fields hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory, struct_pb2
from google.protobuf.descriptor_pb2 import DescriptorProto as MessageProto
from google.protobuf.descriptor_pb2 import FieldDescriptorProto as Field
from google.protobuf.descriptor_pb2 import FileDescriptorProto as FileProto

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS = f"/{SERVICE}/Process"  # the one method: a stream of requests, a stream of answers

EXT_PROC = "envoy.service.ext_proc.v3"
CORE = "envoy.config.core.v3"
TYPE = "envoy.type.v3"
MODE = "envoy.extensions.filters.http.ext_proc.v3"
STRUCT = ".google.protobuf.Struct"

# A field: (name, number, type), the type a scalar's name or a ".full.name" (message or enum).
Spec = tuple[str, int, str]
SCALARS = {
    "bool": Field.TYPE_BOOL,
    "bytes": Field.TYPE_BYTES,
    "string": Field.TYPE_STRING,
    "uint32": Field.TYPE_UINT32,
}


def _file(name: str, package: str, *dependencies: str) -> FileProto:
    return FileProto(name=name, package=package, dependency=dependencies, syntax="proto3")


def _message(
    parent: FileProto | MessageProto,
    name: str,
    fields: Sequence[Spec] = (),
    *,
    enums: Sequence[str] = (),
    repeated: Sequence[str] = (),
    oneof: tuple[str, Sequence[str]] | None = None,
) -> MessageProto:
    """A message in ``parent``: ``fields``; those named in ``repeated`` repeated, those in
    ``oneof`` (its name, its members) one of a kind; the ``.names`` in ``enums`` are enums."""
    adder = parent.message_type if isinstance(parent, FileProto) else parent.nested_type
    message: MessageProto = adder.add(name=name)
    if oneof is not None:
        message.oneof_decl.add(name=oneof[0])
    for field_name, number, kind in fields:
        field = message.field.add(name=field_name, number=number)
        if kind in SCALARS:
            field.type = SCALARS[kind]
        else:
            field.type = Field.TYPE_ENUM if kind in enums else Field.TYPE_MESSAGE
            field.type_name = kind
        field.label = Field.LABEL_REPEATED if field_name in repeated else Field.LABEL_OPTIONAL
        if oneof is not None and field_name in oneof[1]:
            field.oneof_index = 0
    return message


def _enum(parent: FileProto | MessageProto, name: str, values: Sequence[tuple[str, int]]) -> None:
    enum = parent.enum_type.add(name=name)
    for value_name, number in values:
        enum.value.add(name=value_name, number=number)


def _map(parent: MessageProto, owner: str, field: str, number: int, value: str) -> None:
    """A ``map<string, value>`` field of ``owner`` (``parent``'s full name): a repeated nested
    entry message, key 1 and value 2, named as ``protoc`` names it (``FooBarEntry``)."""
    entry = "".join(part.title() for part in field.split("_")) + "Entry"
    _message(parent, entry, [("key", 1, "string"), ("value", 2, value)])
    parent.nested_type[-1].options.map_entry = True
    entries = parent.field.add(name=field, number=number, type=Field.TYPE_MESSAGE)
    entries.label = Field.LABEL_REPEATED
    entries.type_name = f"{owner}.{entry}"


def _http_status() -> FileProto:
    """``envoy/type/v3/http_status.proto``: the status of an immediate response. The enum is
    open (proto3), so any code goes on the wire; the ones named are those kvgate sends."""
    file = _file("envoy/type/v3/http_status.proto", TYPE)
    codes = [
        ("Empty", 0),
        ("OK", 200),
        ("BadRequest", 400),
        ("PayloadTooLarge", 413),
        ("TooManyRequests", 429),
        ("InternalServerError", 500),
        ("ServiceUnavailable", 503),
    ]
    _enum(file, "StatusCode", codes)
    _message(
        file, "HttpStatus", [("code", 1, f".{TYPE}.StatusCode")], enums=[f".{TYPE}.StatusCode"]
    )
    return file


def _base() -> FileProto:
    """``envoy/config/core/v3/base.proto``: headers and metadata."""
    file = _file("envoy/config/core/v3/base.proto", CORE, "google/protobuf/struct.proto")
    _message(
        file,
        "HeaderValue",
        [("key", 1, "string"), ("value", 2, "string"), ("raw_value", 3, "bytes")],
    )
    action = f".{CORE}.HeaderValueOption.HeaderAppendAction"
    option = _message(
        file,
        "HeaderValueOption",
        [("header", 1, f".{CORE}.HeaderValue"), ("append_action", 3, action)],
        enums=[action],
    )
    actions = [
        ("APPEND_IF_EXISTS_OR_ADD", 0),
        ("ADD_IF_ABSENT", 1),
        ("OVERWRITE_IF_EXISTS_OR_ADD", 2),
        ("OVERWRITE_IF_EXISTS", 3),
    ]
    _enum(option, "HeaderAppendAction", actions)
    _message(file, "HeaderMap", [("headers", 1, f".{CORE}.HeaderValue")], repeated=["headers"])
    metadata = _message(file, "Metadata")
    _map(metadata, f".{CORE}.Metadata", "filter_metadata", 1, STRUCT)
    return file


def _processing_mode() -> FileProto:
    """``envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto``: only its enums,
    for the body mode a stream's ``protocol_config`` names."""
    file = _file("envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto", MODE)
    mode = _message(file, "ProcessingMode")
    _enum(mode, "HeaderSendMode", [("DEFAULT", 0), ("SEND", 1), ("SKIP", 2)])
    bodies = [
        ("NONE", 0),
        ("STREAMED", 1),
        ("BUFFERED", 2),
        ("BUFFERED_PARTIAL", 3),
        ("FULL_DUPLEX_STREAMED", 4),
        ("GRPC", 5),
    ]
    _enum(mode, "BodySendMode", bodies)
    return file


def _external_processor() -> FileProto:
    """``envoy/service/ext_proc/v3/external_processor.proto``: the stream's messages."""
    file = _file(
        "envoy/service/ext_proc/v3/external_processor.proto",
        EXT_PROC,
        "google/protobuf/struct.proto",
        "envoy/config/core/v3/base.proto",
        "envoy/type/v3/http_status.proto",
        "envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto",
    )
    e, body_mode = f".{EXT_PROC}", f".{MODE}.ProcessingMode.BodySendMode"
    phases = [
        ("request_headers", 2, f"{e}.HttpHeaders"),
        ("response_headers", 3, f"{e}.HttpHeaders"),
        ("request_body", 4, f"{e}.HttpBody"),
        ("response_body", 5, f"{e}.HttpBody"),
        ("request_trailers", 6, f"{e}.HttpTrailers"),
        ("response_trailers", 7, f"{e}.HttpTrailers"),
    ]
    _message(
        file,
        "ProcessingRequest",
        [
            *phases,
            ("metadata_context", 8, f".{CORE}.Metadata"),
            ("protocol_config", 11, f"{e}.ProtocolConfiguration"),
        ],
        oneof=("request", [name for name, _, _ in phases]),
    )
    answers = [
        ("request_headers", 1, f"{e}.HeadersResponse"),
        ("response_headers", 2, f"{e}.HeadersResponse"),
        ("request_body", 3, f"{e}.BodyResponse"),
        ("response_body", 4, f"{e}.BodyResponse"),
        ("request_trailers", 5, f"{e}.TrailersResponse"),
        ("response_trailers", 6, f"{e}.TrailersResponse"),
        ("immediate_response", 7, f"{e}.ImmediateResponse"),
    ]
    _message(
        file,
        "ProcessingResponse",
        [*answers, ("dynamic_metadata", 8, STRUCT)],
        oneof=("response", [name for name, _, _ in answers]),
    )
    _message(
        file,
        "ProtocolConfiguration",
        [("request_body_mode", 1, body_mode)],
        enums=[body_mode],
    )
    _message(
        file, "HttpHeaders", [("headers", 1, f".{CORE}.HeaderMap"), ("end_of_stream", 3, "bool")]
    )
    _message(file, "HttpBody", [("body", 1, "bytes"), ("end_of_stream", 2, "bool")])
    _message(file, "HttpTrailers", [("trailers", 1, f".{CORE}.HeaderMap")])
    _message(file, "HeadersResponse", [("response", 1, f"{e}.CommonResponse")])
    _message(file, "BodyResponse", [("response", 1, f"{e}.CommonResponse")])
    _message(file, "TrailersResponse", [("header_mutation", 1, f"{e}.HeaderMutation")])
    status = f"{e}.CommonResponse.ResponseStatus"
    common = _message(
        file,
        "CommonResponse",
        [
            ("status", 1, status),
            ("header_mutation", 2, f"{e}.HeaderMutation"),
            ("body_mutation", 3, f"{e}.BodyMutation"),
        ],
        enums=[status],
    )
    _enum(common, "ResponseStatus", [("CONTINUE", 0), ("CONTINUE_AND_REPLACE", 1)])
    _message(
        file,
        "HeaderMutation",
        [("set_headers", 1, f".{CORE}.HeaderValueOption")],
        repeated=["set_headers"],
    )
    mutations = [
        ("body", 1, "bytes"),
        ("clear_body", 2, "bool"),
        ("streamed_response", 3, f"{e}.StreamedBodyResponse"),
    ]
    _message(
        file,
        "BodyMutation",
        mutations,
        oneof=("mutation", [name for name, _, _ in mutations]),
    )
    _message(file, "StreamedBodyResponse", [("body", 1, "bytes"), ("end_of_stream", 2, "bool")])
    _message(
        file,
        "ImmediateResponse",
        [
            ("status", 1, f".{TYPE}.HttpStatus"),
            ("headers", 2, f"{e}.HeaderMutation"),
            ("body", 3, "bytes"),
            ("grpc_status", 4, f"{e}.GrpcStatus"),
            ("details", 5, "string"),
        ],
    )
    _message(file, "GrpcStatus", [("status", 1, "uint32")])
    return file


POOL = descriptor_pool.DescriptorPool()
POOL.Add(FileProto.FromString(struct_pb2.DESCRIPTOR.serialized_pb))
FILES = (_http_status(), _base(), _processing_mode(), _external_processor())
for _proto in FILES:
    POOL.Add(_proto)


def _class(package: str, name: str) -> Any:
    """The message class of ``package.name`` (typed Any: its fields are made at import)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{package}.{name}"))


Struct = _class("google.protobuf", "Struct")

HeaderValue = _class(CORE, "HeaderValue")
HeaderValueOption = _class(CORE, "HeaderValueOption")
HeaderMap = _class(CORE, "HeaderMap")
Metadata = _class(CORE, "Metadata")
HttpStatus = _class(TYPE, "HttpStatus")
ProcessingMode = _class(MODE, "ProcessingMode")

ProcessingRequest = _class(EXT_PROC, "ProcessingRequest")
ProcessingResponse = _class(EXT_PROC, "ProcessingResponse")
ProtocolConfiguration = _class(EXT_PROC, "ProtocolConfiguration")
HttpHeaders = _class(EXT_PROC, "HttpHeaders")
HttpBody = _class(EXT_PROC, "HttpBody")
HttpTrailers = _class(EXT_PROC, "HttpTrailers")
HeadersResponse = _class(EXT_PROC, "HeadersResponse")
BodyResponse = _class(EXT_PROC, "BodyResponse")
TrailersResponse = _class(EXT_PROC, "TrailersResponse")
CommonResponse = _class(EXT_PROC, "CommonResponse")
HeaderMutation = _class(EXT_PROC, "HeaderMutation")
BodyMutation = _class(EXT_PROC, "BodyMutation")
StreamedBodyResponse = _class(EXT_PROC, "StreamedBodyResponse")
ImmediateResponse = _class(EXT_PROC, "ImmediateResponse")
GrpcStatus = _class(EXT_PROC, "GrpcStatus")

Process = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]


def handler(process: Process) -> Any:
    """``process`` served as ``ExternalProcessor/Process`` (what the generated
    ``add_ExternalProcessorServicer_to_server`` registers): add it with
    ``server.add_generic_rpc_handlers``."""
    method = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=ProcessingRequest.FromString,
        response_serializer=ProcessingResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": method})

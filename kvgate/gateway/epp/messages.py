"""The ext_proc v3 messages the picker answers with, built in one place.

The EPP protocol (Gateway API Inference Extension, proposal 004) says where a pick goes: the
``x-gateway-destination-endpoint`` request header (which Envoy's ``ORIGINAL_DST`` cluster
reads) and the same value in dynamic metadata ``envoy.lb`` (for proxies that read metadata
instead); a refusal is an ``ImmediateResponse`` with its status and reason.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from kvgate.gateway.epp import wire
from kvgate.gateway.epp.picker import Refusal
from kvgate.gateway.epp.wire import HeaderValue, HeaderValueOption, HttpStatus, Struct

DESTINATION = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
RETRY_AFTER_S = 1  # told to a refused client: members come back within a health interval

Routed = Callable[[str], wire.ProcessingResponse]  # an endpoint, answered in some phase

CONTINUE_HEADERS = wire.ProcessingResponse(request_headers=wire.HeadersResponse())
CONTINUE_TRAILERS = wire.ProcessingResponse(request_trailers=wire.TrailersResponse())
CONTINUE_RESPONSE_HEADERS = wire.ProcessingResponse(response_headers=wire.HeadersResponse())


def _metadata(endpoint: str) -> Struct:
    metadata = Struct()
    metadata.get_or_create_struct(METADATA_NAMESPACE)[DESTINATION] = endpoint
    return metadata


def _routed(endpoint: str) -> wire.CommonResponse:
    header = HeaderValue(key=DESTINATION, raw_value=endpoint.encode())
    # Replaced, never added to: a client's own header must not name where it goes.
    option = HeaderValueOption(header=header, append_action=OVERWRITE)
    mutation = wire.HeaderMutation(set_headers=[option])
    return wire.CommonResponse(header_mutation=mutation)


# An answer depends on the endpoint alone: built once per member, then serialized as it is.
@lru_cache(maxsize=4096)
def routed_headers(endpoint: str) -> wire.ProcessingResponse:
    """The pick, answered to the request headers (a body-less request, or a full-duplex one
    whose header answer waited for its body)."""
    return wire.ProcessingResponse(
        request_headers=wire.HeadersResponse(response=_routed(endpoint)),
        dynamic_metadata=_metadata(endpoint),
    )


@lru_cache(maxsize=4096)
def routed_body(endpoint: str) -> wire.ProcessingResponse:
    """The pick, answered to a buffered body (its headers not yet sent upstream)."""
    return wire.ProcessingResponse(
        request_body=wire.BodyResponse(response=_routed(endpoint)),
        dynamic_metadata=_metadata(endpoint),
    )


def streamed_body(body: bytes) -> wire.ProcessingResponse:
    """A full-duplex body given back whole, unchanged: in that mode Envoy sends upstream only
    what the processor returns."""
    streamed = wire.StreamedBodyResponse(body=body, end_of_stream=True)
    mutation = wire.BodyMutation(streamed_response=streamed)
    return wire.ProcessingResponse(
        request_body=wire.BodyResponse(response=wire.CommonResponse(body_mutation=mutation))
    )


def refused(refusal: Refusal) -> wire.ProcessingResponse:
    """The proxy answers the client at once: ``refusal``'s status, its reason as the body."""
    retry = HeaderValue(key="retry-after", raw_value=str(RETRY_AFTER_S).encode())
    kind = HeaderValue(key="content-type", raw_value=b"text/plain")
    headers = wire.HeaderMutation(
        set_headers=[HeaderValueOption(header=retry), HeaderValueOption(header=kind)]
    )
    answer = wire.ImmediateResponse(
        status=HttpStatus(code=refusal.status),
        headers=headers,
        body=refusal.reason.encode()[:1024],
        details=f"kvgate_epp_{refusal.status}",
    )
    return wire.ProcessingResponse(immediate_response=answer)


def subset_hint(request: wire.ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows (``envoy.lb.subset_hint``), or None: any member."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return [v.string_value for v in fields[SUBSET_KEY].list_value.values]

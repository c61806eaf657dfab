"""The spec's own JSON Schema (``schema.json``) for each wire revision, as validators.

Tests (and fuzzers) check every message the server sends against the revision it was sent
on. A result is checked twice: the JSON-RPC envelope, then the method's result type. The
Tasks extension's messages (``CreateTaskResult`` answering a ``tools/call``, the ``tasks/*``
results) are checked against the extension's own schema, ``mcp/ext-tasks.json``: a copy of
``schema/draft/schema.json`` of github.com/modelcontextprotocol/ext-tasks at commit
e4345978be1f (2026-08-21).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator

MODERN_WIRE = "2026-07-28"
LEGACY_WIRE = "2025-11-25"
TASKS_WIRE = "ext-tasks"  # the io.modelcontextprotocol/tasks extension (see above)

RESULT_TYPES = {
    "server/discover": "DiscoverResult",
    "initialize": "InitializeResult",
    "ping": "EmptyResult",
    "tools/list": "ListToolsResult",
    "tools/call": "CallToolResult",
    "resources/list": "ListResourcesResult",
    "resources/templates/list": "ListResourceTemplatesResult",
    "resources/read": "ReadResourceResult",
    "prompts/list": "ListPromptsResult",
    "prompts/get": "GetPromptResult",
    "subscriptions/listen": "SubscriptionsListenResult",
}

TASK_RESULT_TYPES = {
    "tasks/get": "GetTaskResult",
    "tasks/update": "UpdateTaskResult",
    "tasks/cancel": "CancelTaskResult",
}

NOTIFICATION_TYPES = {
    "notifications/progress": "ProgressNotification",
    "notifications/message": "LoggingMessageNotification",
    "notifications/subscriptions/acknowledged": "SubscriptionsAcknowledgedNotification",
    "notifications/tools/list_changed": "ToolListChangedNotification",
    "notifications/prompts/list_changed": "PromptListChangedNotification",
    "notifications/resources/list_changed": "ResourceListChangedNotification",
    "notifications/resources/updated": "ResourceUpdatedNotification",
}


def wire_for(protocol_version: str) -> str:
    """The schema file a message on ``protocol_version`` is checked against (older legacy
    revisions are checked against the newest legacy schema, a superset for our messages)."""
    return MODERN_WIRE if protocol_version >= MODERN_WIRE else LEGACY_WIRE


@cache
def _definitions(wire: str) -> dict[str, Any]:
    text = resources.files("kvgate.schemas").joinpath("mcp", f"{wire}.json").read_text("utf-8")
    definitions: dict[str, Any] = json.loads(text)["$defs"]
    return definitions


@cache
def validator(wire: str, definition: str) -> Draft202012Validator:
    """A validator for one ``$defs`` entry of the wire's schema."""
    defs = _definitions(wire)
    if definition not in defs:
        raise KeyError(f"{definition} is not defined in the {wire} schema")
    return Draft202012Validator({"$defs": defs, "$ref": f"#/$defs/{definition}"})


def validate_server_message(wire: str, message: dict[str, Any], method: str | None = None) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``message`` is a valid server message.

    ``method`` is the request's method, needed to check a result's own shape.
    """
    if "method" in message:
        name = NOTIFICATION_TYPES.get(message["method"], "JSONRPCNotification")
        validator(wire, name).validate(message)
    elif "error" in message:
        validator(wire, "JSONRPCErrorResponse").validate(message)
    else:
        validator(wire, "JSONRPCResultResponse").validate(message)
        if method is not None:
            validator(*_result_type(wire, method, message["result"])).validate(message["result"])


def _result_type(wire: str, method: str, result: Any) -> tuple[str, str]:
    """The schema and definition a ``method``'s result is checked against."""
    if method in TASK_RESULT_TYPES:
        return TASKS_WIRE, TASK_RESULT_TYPES[method]
    if method == "tools/call" and isinstance(result, dict) and result.get("resultType") == "task":
        return TASKS_WIRE, "CreateTaskResult"
    return wire, RESULT_TYPES[method]

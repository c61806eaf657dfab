"""The Responses API's output items as the builder makes them from a generation."""

from __future__ import annotations

from kvgate.gateway.generation import Completion
from kvgate.gateway.openai.responses_output import ResponseBuilder


def test_an_empty_reply_is_one_empty_message_streamed_and_in_the_response() -> None:
    """A model may end its reply at once (its first token the end of text): clients read
    ``output[0]`` as the message, as OpenAI and vLLM answer such a reply."""
    builder = ResponseBuilder("m", {}, {})
    builder.start()
    events = builder.add(Completion("", "stop", 5, 1, 0, 0))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    (message,) = builder.response("completed")["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == ""

import pytest

from kvgate.schemas.tools import inference_tools
from kvgate.schemas.validation import ArgumentValidator

GENERATE, CHAT, _ = inference_tools("tiny", 2048)


def test_valid_arguments_have_no_problems() -> None:
    validator = ArgumentValidator("generate", GENERATE["inputSchema"])
    assert (
        validator.problems({"prompt": "hi", "max_tokens": 3, "temperature": 0, "stop": ["\n"]})
        == []
    )


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "arguments: 'prompt' is a required property"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens: 0 is less than the minimum of 1"),
        (
            {"prompt": "hi", "max_tokens": 4096},
            "max_tokens: 4096 is greater than the maximum of 2048",
        ),
        ({"prompt": "hi", "temperature": "hot"}, "temperature: 'hot' is not of type 'number'"),
        ({"prompt": "hi", "top_p": 0}, "top_p: 0 is less than or equal to the minimum of 0"),
        (
            {"prompt": "hi", "extra": 1},
            "Additional properties are not allowed ('extra' was unexpected)",
        ),
        ({"prompt": "hi", "cache_key": ""}, "cache_key: '' should be non-empty"),
    ],
)
def test_each_problem_names_the_argument(arguments: dict, expected: str) -> None:
    problems = ArgumentValidator("generate", GENERATE["inputSchema"]).problems(arguments)
    assert any(expected in problem for problem in problems), problems


def test_nested_paths_are_named() -> None:
    problems = ArgumentValidator("chat", CHAT["inputSchema"]).problems(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}
    )
    roles = "['system', 'developer', 'user', 'assistant', 'tool']"
    assert problems == [f"messages[1].role: 'robot' is not one of {roles}"]


def test_a_broken_schema_fails_at_construction() -> None:
    with pytest.raises(Exception, match="not valid"):
        ArgumentValidator("bad", {"type": "object", "properties": {"x": {"type": 5}}})

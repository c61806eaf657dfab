"""The official ``openai`` client against kvgate's OpenAI-compatible API.

python examples/openai_client.py [BASE_URL]     (default http://127.0.0.1:8000/v1)
"""

from __future__ import annotations

import sys

from openai import OpenAI


def main(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="kvgate")  # no key is checked unless configured
    model = client.models.list().data[0].id
    print("model:", model)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=16,
        temperature=0,
    )
    print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason)
    print("usage:", chat.usage.prompt_tokens, "+", chat.usage.completion_tokens, "tokens")
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=16, stream=True
    )
    print("stream:", repr("".join(chunk.choices[0].text for chunk in stream)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1")

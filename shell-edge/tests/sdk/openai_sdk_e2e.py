"""End-to-end check of an iop Edge with the official OpenAI Python SDK.

Usage: openai_sdk_e2e.py BASE_URL API_KEY

Exits non-zero (with a message) on the first failed expectation.
"""

import sys

from openai import OpenAI


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def main() -> None:
    base_url, key = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)

    models = [m.id for m in client.models.list().data]
    check("mock" in models, f"models list has mock: {models}")

    # Chat Completions, non-streaming.
    r = client.chat.completions.create(
        model="mock:tokens=5",
        messages=[{"role": "user", "content": "hello"}],
    )
    check(r.choices[0].message.content, "chat: content")
    check(r.choices[0].finish_reason == "stop", f"chat: finish_reason {r.choices[0].finish_reason}")
    check(r.usage and r.usage.completion_tokens == 5, f"chat: usage {r.usage}")

    # Chat Completions, streaming with usage.
    text, usage, finish = "", None, None
    stream = client.chat.completions.create(
        model="mock:tokens=6",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check(text, "chat stream: text")
    check(finish == "stop", f"chat stream: finish {finish}")
    check(usage and usage.completion_tokens == 6, f"chat stream: usage {usage}")

    # Chat Completions, tool calls (streamed and not).
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }]
    r = client.chat.completions.create(
        model="mock:tool_call=1",
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,
    )
    calls = r.choices[0].message.tool_calls
    check(calls and calls[0].function.name, f"chat: tool call {r.choices[0].message}")
    check(r.choices[0].finish_reason == "tool_calls", "chat: tool_calls finish")
    names, args = set(), ""
    for chunk in client.chat.completions.create(
        model="mock:tool_call=1",
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,
        stream=True,
    ):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.add(tc.function.name)
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
    check(names, "chat stream: tool call name")

    # Responses, non-streaming and streaming.
    resp = client.responses.create(model="mock:tokens=4", input="hello")
    check(resp.output_text, "responses: output_text")
    check(resp.usage and resp.usage.output_tokens == 4, f"responses: usage {resp.usage}")
    deltas, completed = "", None
    for event in client.responses.create(model="mock:tokens=4", input="hello", stream=True):
        if event.type == "response.output_text.delta":
            deltas += event.delta
        elif event.type == "response.completed":
            completed = event.response
    check(deltas, "responses stream: deltas")
    check(completed and completed.usage.output_tokens == 4, "responses stream: completed with usage")
    resp = client.responses.create(
        model="mock:tool_call=1",
        input="weather?",
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    )
    check(any(item.type == "function_call" for item in resp.output), f"responses: function call {resp.output}")

    # Errors come back typed.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        check(False, "unknown model must fail")
    except Exception as e:  # openai.NotFoundError
        check(getattr(e, "status_code", None) == 404, f"unknown model: {e!r}")
    print("openai sdk e2e: ok")


if __name__ == "__main__":
    main()

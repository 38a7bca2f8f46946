"""End-to-end check of an iop Edge with the official OpenAI Python SDK.

Usage: openai_sdk_e2e.py BASE_URL API_KEY

The Edge is expected to run with a short `edge.sse_keep_alive_ms` (well
under the 200 ms between the slow streams' tokens), so its keep-alive
comments fall between numbered events.

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

    # The prompt cache's counts when the provider reports them, and no
    # details when it does not.
    check(r.usage.prompt_tokens_details is None, f"chat: no cache reported {r.usage}")
    r = client.chat.completions.create(
        model="mock:tokens=1,cache_read=1",
        messages=[{"role": "user", "content": "hello"}],
    )
    details = r.usage.prompt_tokens_details
    check(details and details.cached_tokens == 1, f"chat: cached tokens {r.usage}")

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

    # Reasoning the provider streams is a reasoning item before the message.
    reasoning, completed = "", None
    with client.responses.stream(model="mock:tokens=2", input="think", reasoning={"effort": "low"}) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                reasoning += event.delta
        completed = stream.get_final_response()
    check(reasoning, "responses stream: reasoning deltas")
    kinds = [item.type for item in completed.output]
    check(kinds == ["reasoning", "message"], f"responses stream: items {kinds}")
    check(completed.output[0].content[0].text == reasoning, "responses stream: reasoning item text")
    check(completed.reasoning.effort == "low", f"responses: reasoning echo {completed.reasoning}")
    resp = client.responses.create(model="mock:tokens=2", input="think", reasoning={"effort": "low"})
    check(resp.output[0].type == "reasoning" and resp.output_text, f"responses: reasoning item {resp.output}")
    # Passed back (manual context), the reasoning item is accepted.
    again = client.responses.create(
        model="mock:tokens=2",
        input=[{"role": "user", "content": "think"}, *[i.model_dump(exclude_none=True) for i in resp.output],
               {"role": "user", "content": "more"}],
    )
    check(again.output_text, "responses: reasoning item passed back")

    durable_responses(client)
    keep_alives_between_numbered_events(client)

    # Errors come back typed.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        check(False, "unknown model must fail")
    except Exception as e:  # openai.NotFoundError
        check(getattr(e, "status_code", None) == 404, f"unknown model: {e!r}")
    print("openai sdk e2e: ok")


def durable_responses(client) -> None:
    """Stored responses (SPEC §6): retrieve, resume, background, cancel, delete."""
    # Stored by default, as OpenAI's: the streamed events, then the same
    # stream from the store, and a resume after any sequence number.
    live = list(client.responses.create(model="mock:tokens=6", input="keep", stream=True))
    check(live[-1].type == "response.completed", f"durable: completed {live[-1].type}")
    rid = live[0].response.id
    got = client.responses.retrieve(rid)
    check(got.status == "completed" and got.output_text == live[-1].response.output_text,
          f"durable: retrieve {got.status} {got.output_text!r}")
    numbers = [e.sequence_number for e in live]
    check(numbers == list(range(len(live))), f"durable: sequence numbers {numbers}")
    for n in (0, 4, len(live) - 2):
        rest = list(client.responses.retrieve(rid, stream=True, starting_after=n))
        check([e.sequence_number for e in rest] == numbers[n + 1:],
              f"durable: resume after {n}: {[e.sequence_number for e in rest]}")
        check([e.type for e in rest] == [e.type for e in live[n + 1:]], "durable: same events")

    # The input of the response, and a continued conversation.
    items = client.responses.input_items.list(rid)
    check(len(items.data) == 1, f"durable: input items {items}")
    follow = client.responses.create(model="mock:tokens=2", input="more", previous_response_id=rid)
    check(follow.previous_response_id == rid, "durable: previous_response_id echoed")
    check(follow.usage.input_tokens > got.usage.input_tokens, "durable: history reached the provider")

    # Background: answered at once, then fetched, cancelled, deleted.
    bg = client.responses.create(model="mock:tokens=400,tps=50", input="slow", background=True)
    check(bg.background and bg.status in ("queued", "in_progress"), f"durable: background {bg.status}")
    cancelled = client.responses.cancel(bg.id)
    check(cancelled.status == "cancelled", f"durable: cancel {cancelled.status}")
    client.responses.delete(bg.id)
    try:
        client.responses.retrieve(bg.id)
        check(False, "durable: a deleted response is gone")
    except Exception as e:  # openai.NotFoundError
        check(getattr(e, "status_code", None) == 404, f"durable: deleted: {e!r}")

    # Stored chat completions, and an idempotent retry.
    c = client.chat.completions.create(
        model="mock:tokens=3", messages=[{"role": "user", "content": "hi"}], store=True)
    again = client.chat.completions.retrieve(c.id)
    check(again.choices[0].message.content == c.choices[0].message.content, "durable: stored chat")
    first = client.chat.completions.create(
        model="mock:tokens=3", messages=[{"role": "user", "content": "once"}],
        extra_headers={"Idempotency-Key": "sdk-e2e-1"})
    second = client.chat.completions.with_raw_response.create(
        model="mock:tokens=3", messages=[{"role": "user", "content": "once"}],
        extra_headers={"Idempotency-Key": "sdk-e2e-1"})
    check(second.headers.get("idempotent-replayed") == "true", "durable: replayed header")
    check(second.parse().id == first.id, "durable: the same completion")


def keep_alives_between_numbered_events(client) -> None:
    """Keep-alive comments on durable streams (SSE `id:` lines) do not
    break the SDK: a blank line after a comment would be an event with
    empty data to a decoder that keeps the last event id, as the SDK's."""
    slow = "mock:tokens=4,tps=5"
    # The raw stream first: the case is really there.
    with client.chat.completions.with_streaming_response.create(
            model=slow, messages=[{"role": "user", "content": "slow"}], stream=True,
            extra_headers={"Idempotency-Key": "sdk-keep-alive-raw"}) as r:
        check(r.status_code == 200, f"keep-alive: raw status {r.status_code}")
        lines = list(r.iter_lines())
    comments = [i for i, line in enumerate(lines) if line.startswith(":")]
    ids = [line for line in lines if line.startswith("id:")]
    check(comments and ids, f"keep-alive: comments between numbered events {lines}")
    check(all(lines[i + 1] != "" for i in comments if i + 1 < len(lines)),
          f"keep-alive: no blank line after a comment {lines}")

    # The SDK reads the same kind of stream to its end.
    text, finish = "", None
    stream = client.chat.completions.create(
        model=slow, messages=[{"role": "user", "content": "slow"}], stream=True,
        extra_headers={"Idempotency-Key": "sdk-keep-alive-chat"})
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check(text.count("tok") == 4 and finish == "stop", f"keep-alive: chat stream {text!r} {finish}")
    events = list(client.responses.create(model=slow, input="slow", stream=True))
    check(events[-1].type == "response.completed", f"keep-alive: responses stream {events[-1].type}")
    check(events[-1].response.output_text.count("tok") == 4,
          f"keep-alive: responses text {events[-1].response.output_text!r}")


if __name__ == "__main__":
    main()

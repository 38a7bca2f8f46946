"""End-to-end check of an iop Edge with the official Anthropic Python SDK.

Usage: anthropic_sdk_e2e.py BASE_URL API_KEY MOCK_URL UPSTREAM

BASE_URL is the Edge (the SDK adds /v1/messages), run with a short
`edge.sse_keep_alive_ms` (well under the 200 ms between the slow stream's
tokens); MOCK_URL is the mock
provider behind it, whose /mock/stats counts provider calls (and the
images, documents and anthropic-beta headers they carried). UPSTREAM is
`openai` (an OpenAI-compatible provider) or `messages` (a Messages-only
one behind the `anthropic` adapter). The Edge's provider has one slot and
a queue of two (the 429 check fills them).
Exits non-zero (with a message) on the first failed expectation.
"""

import json
import sys
import threading
import time
import urllib.request

import anthropic
from anthropic import Anthropic


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def expected_text(tokens):
    return "".join("tok0" if i == 0 else f" tok{i}" for i in range(tokens))


def mock_stats(mock_url):
    with urllib.request.urlopen(f"{mock_url}/mock/stats", timeout=10) as r:
        return json.load(r)


def provider_calls(mock_url):
    return mock_stats(mock_url)["requests"]


def status(base_url, key):
    req = urllib.request.Request(f"{base_url}/status", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def expect_error(cls, status_code, call, what):
    try:
        call()
    except cls as e:
        check(e.status_code == status_code, f"{what}: status {e.status_code}")
        check(e.body["type"] == "error" if isinstance(e.body, dict) else True, f"{what}: body {e.body}")
        return e
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"FAILED: {what}: raised {type(e).__name__}: {e}")
    raise SystemExit(f"FAILED: {what}: no error")


def main() -> None:
    base_url, key, mock_url, upstream = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    client = Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=30)
    user = [{"role": "user", "content": "hello there"}]

    # messages.create: text, stop reason, the provider's usage.
    m = client.messages.create(model="mock:tokens=5", max_tokens=64, system="be brief", messages=user)
    check(m.type == "message" and m.role == "assistant", f"create: {m}")
    check(m.id.startswith("msg_"), f"create: id {m.id}")
    check(m.content[0].type == "text" and m.content[0].text == expected_text(5), f"create: content {m.content}")
    check(m.stop_reason == "end_turn", f"create: stop_reason {m.stop_reason}")
    check(m.usage.output_tokens == 5, f"create: usage {m.usage}")
    prompt_tokens = m.usage.input_tokens
    check(prompt_tokens == (len("be brief") + len("hello there") + 3) // 4, f"create: input tokens {m.usage}")

    # The prompt cache's counts, as the provider reported them: 2 of the
    # prompt's tokens read from its cache, 1 written to it.
    cached = "mock:tokens=2,cache_read=2,cache_write=1"
    m = client.messages.create(model=cached, max_tokens=64, system="be brief", messages=user)
    counts = (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.cache_creation_input_tokens)
    check(counts == (prompt_tokens - 3, 2, 1), f"cache counts: {m.usage}")
    with client.messages.stream(model=cached, max_tokens=64, system="be brief", messages=user) as stream:
        final = stream.get_final_message()
    counts = (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.cache_creation_input_tokens)
    check(counts == (prompt_tokens - 3, 2, 1), f"streamed cache counts: {final.usage}")

    # count_tokens: the Edge's estimate of the same prompt.
    counted = client.messages.count_tokens(model="mock", system="be brief", messages=user)
    check(counted.input_tokens == prompt_tokens, f"count_tokens: {counted} vs {prompt_tokens}")

    # max_tokens cuts the answer: stop reason max_tokens.
    m = client.messages.create(model="mock:tokens=10", max_tokens=3, messages=user)
    check(m.stop_reason == "max_tokens" and m.usage.output_tokens == 3, f"max_tokens: {m.stop_reason} {m.usage}")

    # messages.stream: text_stream, then the final message.
    with client.messages.stream(model="mock:tokens=6", max_tokens=64, messages=user) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(text == expected_text(6), f"stream: text {text!r}")
    check(final.content[0].text == text, f"stream: final content {final.content}")
    check(final.stop_reason == "end_turn", f"stream: stop_reason {final.stop_reason}")
    check(final.usage.output_tokens == 6 and final.usage.input_tokens == 3, f"stream: usage {final.usage}")

    # A durable stream (numbered events) silent between its tokens longer
    # than the Edge's keep-alive interval (the test runs it at 50 ms): the
    # `ping` keep-alives fall between numbered events, and the SDK reads
    # the stream to its end.
    slow = "mock:tokens=4,tps=5"
    with client.messages.with_streaming_response.create(
            model=slow, max_tokens=64, messages=user, stream=True,
            extra_headers={"Idempotency-Key": "sdk-keep-alive-raw"}) as r:
        lines = list(r.iter_lines())
    pings = lines.count("event: ping")
    check(pings > 0 and any(line.startswith("id:") for line in lines),
          f"keep-alive: pings between numbered events {lines}")
    with client.messages.stream(model=slow, max_tokens=64, messages=user,
                                extra_headers={"Idempotency-Key": "sdk-keep-alive"}) as stream:
        text = "".join(stream.text_stream)
    check(text == expected_text(4), f"keep-alive: stream text {text!r}")

    # The raw events: message_start has the prompt's tokens when the
    # provider says them before its answer (a Messages provider); an
    # OpenAI-compatible stream says them at its end, so message_start has
    # 0 and message_delta the totals, input_tokens included.
    raw = list(client.messages.create(model="mock:tokens=2", max_tokens=64, messages=user, stream=True))
    check(raw[0].type == "message_start", f"raw: first event {raw[0].type}")
    started = raw[0].message.usage.input_tokens
    check(started == (3 if upstream == "messages" else 0), f"raw: message_start usage {raw[0].message.usage}")
    delta = next(e for e in raw if e.type == "message_delta")
    check(delta.usage.input_tokens == 3 and delta.usage.output_tokens == 2, f"raw: message_delta usage {delta.usage}")

    # Thinking: the provider's reasoning comes back as a thinking block.
    with client.messages.stream(
        model="mock:tokens=2",
        max_tokens=4096,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=user,
    ) as stream:
        thinking = ""
        for event in stream:
            if event.type == "thinking":
                thinking += event.thinking
        final = stream.get_final_message()
    kinds = [b.type for b in final.content]
    check(kinds == ["thinking", "text"], f"thinking: blocks {kinds}")
    check(thinking and final.content[0].thinking == thinking, f"thinking: {thinking!r}")

    # A tool-use round trip with a forced tool choice.
    tools = [{
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    }]
    ask = [{"role": "user", "content": "weather in Paris?"}]
    m = client.messages.create(
        model="mock:tool_call=1,tokens=2",
        max_tokens=256,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    check(m.stop_reason == "tool_use", f"tool: stop_reason {m.stop_reason}")
    call = next(b for b in m.content if b.type == "tool_use")
    check(call.name == "get_weather" and isinstance(call.input, dict), f"tool: {call}")
    with client.messages.stream(
        model="mock:tool_call=1,tokens=2",
        max_tokens=256,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        streamed = stream.get_final_message()
    streamed_call = next(b for b in streamed.content if b.type == "tool_use")
    check(streamed_call.input == call.input, f"tool stream: {streamed_call.input} vs {call.input}")
    answer = client.messages.create(
        model="mock:tokens=3",
        max_tokens=256,
        messages=[
            *ask,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C and sunny"}]},
        ],
        tools=tools,
    )
    check(answer.content[0].text == expected_text(3) and answer.stop_reason == "end_turn", f"tool result: {answer}")

    # A PDF and an image inside a tool result, and a PDF in the turn: they
    # reach the provider (in its own API's shape), whole and streamed.
    before = mock_stats(mock_url)
    pdf_data = "JVBERi0xLjQK"
    shot = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [
                {"type": "text", "text": "the screen and its manual"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "document", "title": "Manual",
                 "source": {"type": "base64", "media_type": "application/pdf", "data": pdf_data}},
            ]},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": pdf_data}},
            {"type": "text", "text": "compare them"},
        ]},
    ]
    answer = client.messages.create(model="mock:tokens=3", max_tokens=256, messages=shot, tools=tools)
    check(answer.content[0].text == expected_text(3), f"attachments: {answer}")
    with client.messages.stream(model="mock:tokens=3", max_tokens=256, messages=shot, tools=tools) as stream:
        check("".join(stream.text_stream) == expected_text(3), "attachments: stream")
    after = mock_stats(mock_url)
    check((after["images"] - before["images"], after["documents"] - before["documents"]) == (2, 4),
          f"attachments reached the provider: {before} -> {after}")

    # anthropic-beta (the SDK's betas): a Messages provider gets it, an
    # OpenAI-compatible one does not.
    before = mock_stats(mock_url)["anthropic_beta"]
    b = client.beta.messages.create(model="mock:tokens=2", max_tokens=64, messages=user,
                                    betas=["pdfs-2024-09-25"])
    check(b.content[0].text == expected_text(2), f"beta: {b}")
    carried = mock_stats(mock_url)["anthropic_beta"] - before
    check(carried == (1 if upstream == "messages" else 0), f"beta carried {carried} ({upstream})")

    # An Idempotency-Key: the retry is the same message, from no second call.
    before = provider_calls(mock_url)
    headers = {"Idempotency-Key": "sdk-once-1"}
    first = client.messages.create(model="mock:tokens=4", max_tokens=64, messages=user, extra_headers=headers)
    again = client.messages.create(model="mock:tokens=4", max_tokens=64, messages=user, extra_headers=headers)
    check(again.id == first.id and again.content == first.content, f"idempotency: {first.id} vs {again.id}")
    check(provider_calls(mock_url) == before + 1, "idempotency: one provider call")

    # Errors, as the SDK's own classes.
    bad_key = Anthropic(base_url=base_url, api_key="sk-wrong-0123456789", max_retries=0, timeout=30)
    e = expect_error(anthropic.AuthenticationError, 401,
                     lambda: bad_key.messages.create(model="mock", max_tokens=8, messages=user), "401")
    check(e.body["error"]["type"] == "authentication_error", f"401 body {e.body}")
    e = expect_error(anthropic.NotFoundError, 404,
                     lambda: client.messages.create(model="no-such-model", max_tokens=8, messages=user), "404")
    check(e.body["error"]["type"] == "not_found_error", f"404 body {e.body}")
    e = expect_error(anthropic.BadRequestError, 400,
                     lambda: client.messages.create(model="mock", max_tokens=8, messages=user,
                                                   extra_body={"temperature": 1.5}),
                     "400")
    check("temperature" in e.message, f"400 names the field: {e.message}")
    pdf = [{"role": "user", "content": [{"type": "document", "source": {
        "type": "file", "file_id": "file_011"}}]}]
    e = expect_error(anthropic.BadRequestError, 400,
                     lambda: client.messages.create(model="mock", max_tokens=8, messages=pdf), "400 file id")
    check("source.type" in e.message, f"400 file id names the field: {e.message}")

    # A 429: the one slot busy and the queue of two full.
    slow = "mock:tokens=30,tps=10"

    def hold():
        try:
            with client.messages.stream(model=slow, max_tokens=64, messages=user) as s:
                for _ in s.text_stream:
                    pass
        except Exception:  # noqa: BLE001 (the test ends them)
            pass

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 15
    while status(base_url, key)["instance"]["queue_depth"] < 2:
        check(time.time() < deadline, "429: the queue never filled")
        time.sleep(0.05)
    e = expect_error(anthropic.RateLimitError, 429,
                     lambda: client.messages.create(model="mock", max_tokens=8, messages=user), "429")
    check(e.body["error"]["type"] == "rate_limit_error", f"429 body {e.body}")
    check(e.response.headers.get("retry-after"), "429: retry-after")
    for t in threads:
        t.join(timeout=30)
    print("anthropic sdk e2e: ok")


if __name__ == "__main__":
    main()

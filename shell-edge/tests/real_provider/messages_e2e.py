"""End-to-end check of the Anthropic Messages API through an iop Edge with
real servers: the official `anthropic` SDK against the llama.cpp server
(an `openai` provider) and against LiteLLM's proxy serving the same model on
its own Messages API (an `anthropic` provider); the official `openai` and
`ollama` clients against that Messages-only upstream.

Usage: messages_e2e.py EDGE_URL API_KEY MODEL VIA_MESSAGES_MODEL LIMITED_KEY PROVIDER_LOG

LIMITED_KEY may make one request a minute; PROVIDER_LOG is the llama.cpp
server's access log, where every provider call (LiteLLM's too) is one
`POST /v1/chat/completions` line.

Exits non-zero (with a message) on the first failed expectation.
"""

import json
import sys
import time

import anthropic
import ollama
from anthropic import Anthropic
from openai import OpenAI


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def expect_error(cls, status_code, call, what):
    try:
        call()
    except cls as e:
        check(e.status_code == status_code, f"{what}: status {e.status_code}")
        return e
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"FAILED: {what}: raised {type(e).__name__}: {e}")
    raise SystemExit(f"FAILED: {what}: no error")


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def provider_calls(log):
    """Chat calls the llama.cpp server has answered so far (its access log)."""
    with open(log, encoding="utf-8", errors="replace") as f:
        return sum('"POST /v1/chat/completions' in line for line in f)


def settled_provider_calls(log):
    """The count once no call is still arriving: the same twice, 0.5 s apart."""
    count = provider_calls(log)
    while True:
        time.sleep(0.5)
        again = provider_calls(log)
        if again == count:
            return count
        count = again


def main() -> None:
    edge, key, model, via_messages, limited_key, log = sys.argv[1:7]
    client = Anthropic(base_url=edge, api_key=key, max_retries=0, timeout=120)
    # Greedy where text is checked (a sampled answer may be empty); this SDK
    # takes sampling parameters as extra fields.
    greedy = {"temperature": 0}
    user = [{"role": "user", "content": "Say hello in three words."}]

    for name in (model, via_messages):
        # messages.create: the answer, its stop reason and the provider's usage.
        m = client.messages.create(model=name, max_tokens=16, system="You are terse.", messages=user,
                                   extra_body=greedy)
        check(m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), f"{name} create: {m}")
        check(text_of(m), f"{name} create: text {m.content}")
        check(m.stop_reason in ("end_turn", "max_tokens"), f"{name} create: stop_reason {m.stop_reason}")
        check((m.usage.input_tokens or 0) > 0 and (m.usage.output_tokens or 0) > 0, f"{name} create: usage {m.usage}")

        # Prompt-cache breakpoints (as coding agents send them) are carried
        # to a Messages provider and left out for an OpenAI-compatible one:
        # both answer.
        cached_system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
        m = client.messages.create(model=name, max_tokens=8, system=cached_system, messages=user,
                                   tools=[{"name": "noop", "input_schema": {"type": "object"},
                                           "cache_control": {"type": "ephemeral"}}],
                                   extra_body=greedy)
        check(m.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"{name} cache_control: {m}")
        check((m.usage.output_tokens or 0) > 0, f"{name} cache_control: usage {m.usage}")

        # messages.stream: text_stream, then the final message.
        with client.messages.stream(model=name, max_tokens=16, messages=user, extra_body=greedy) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        check(text and text_of(final) == text, f"{name} stream: {text!r} vs {final.content}")
        check(final.stop_reason in ("end_turn", "max_tokens"), f"{name} stream: stop_reason {final.stop_reason}")

        # max_tokens cuts it: stop reason max_tokens.
        m = client.messages.create(model=name, max_tokens=2, extra_body=greedy,
                                   messages=[{"role": "user", "content": "Count from one to twenty."}])
        check(m.stop_reason == "max_tokens", f"{name} max_tokens: {m.stop_reason} {m.content}")

        # count_tokens: the Edge's estimate, no provider call.
        counted = client.messages.count_tokens(model=name, messages=user)
        check(counted.input_tokens > 0, f"{name} count_tokens: {counted}")

        # A tool-use round trip with a forced tool choice: the model must
        # call the tool (llama.cpp constrains its output to the tool's
        # schema), whole and streamed; its result goes back as a
        # tool_result block and the model answers in text.
        tools = [{
            "name": "get_weather",
            "description": "The weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }]
        forced = {"type": "tool", "name": "get_weather"}
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        m = client.messages.create(model=name, max_tokens=64, messages=ask, tools=tools, tool_choice=forced,
                                   extra_body=greedy)
        check(m.stop_reason == "tool_use", f"{name} tool: stop_reason {m.stop_reason} {m.content}")
        call = next((b for b in m.content if b.type == "tool_use"), None)
        check(call is not None and call.name == "get_weather", f"{name} tool: {m.content}")
        check(isinstance(call.input, dict) and isinstance(call.input.get("city"), str), f"{name} tool input: {call.input}")
        check(call.id, f"{name} tool: an id {call}")
        with client.messages.stream(model=name, max_tokens=64, messages=ask, tools=tools, tool_choice=forced,
                                    extra_body=greedy) as stream:
            partial = "".join(e.partial_json for e in stream if e.type == "input_json")
            streamed = stream.get_final_message()
        check(streamed.stop_reason == "tool_use", f"{name} tool stream: {streamed.stop_reason} {streamed.content}")
        streamed_call = next((b for b in streamed.content if b.type == "tool_use"), None)
        check(streamed_call is not None and streamed_call.name == "get_weather", f"{name} tool stream: {streamed.content}")
        check(json.loads(partial) == streamed_call.input, f"{name} tool stream: {partial!r} vs {streamed_call.input}")
        check(streamed_call.input == call.input, f"{name} tool stream: {streamed_call.input} vs {call.input} (greedy)")
        turn = [b.model_dump(exclude_none=True) for b in m.content]
        if name == via_messages:
            # LiteLLM's proxy sends llama.cpp's server an assistant turn of
            # tool calls alone without a `content`, which the model's chat
            # template cannot render (HTTP 500, the same without iop in
            # front): the turn says something too.
            turn.insert(0, {"type": "text", "text": "Let me check."})
        answer = client.messages.create(
            model=name,
            max_tokens=16,
            extra_body=greedy,
            tools=tools,
            messages=[
                *ask,
                {"role": "assistant", "content": turn},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "18 degrees and sunny"}]},
            ],
        )
        check(answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"{name} tool result: {answer}")
        check(text_of(answer) or any(b.type == "tool_use" for b in answer.content), f"{name} tool result: {answer}")

        # An Idempotency-Key: the retry is the same message, replayed, and
        # the provider is called once.
        headers = {"Idempotency-Key": f"messages-real-{name}"}
        before = settled_provider_calls(log)
        first = client.messages.create(model=name, max_tokens=8, messages=user, extra_headers=headers)
        raw = client.messages.with_raw_response.create(model=name, max_tokens=8, messages=user, extra_headers=headers)
        again = raw.parse()
        check(raw.headers.get("idempotent-replayed") == "true", f"{name} idempotency: headers {raw.headers}")
        check(again.id == first.id and again.content == first.content, f"{name} idempotency: {first.id} vs {again.id}")
        streamed_headers = {"Idempotency-Key": f"messages-real-stream-{name}"}
        finals = []
        for _ in range(2):
            with client.messages.stream(model=name, max_tokens=8, messages=user,
                                        extra_headers=streamed_headers) as stream:
                text = "".join(stream.text_stream)
                finals.append((stream.get_final_message(), text))
        (live, live_text), (replayed, replayed_text) = finals
        check(replayed.id == live.id and replayed_text == live_text, f"{name} idempotency: streamed {finals}")
        calls = settled_provider_calls(log) - before
        check(calls == 2, f"{name} idempotency: {calls} provider calls for two keys")

        # Beta features (the SDK's betas): a Messages provider (LiteLLM's
        # proxy) gets them as anthropic-beta, an OpenAI-compatible one
        # (llama.cpp's server) none; both answer.
        b = client.beta.messages.create(model=name, max_tokens=8, messages=user, betas=["pdfs-2024-09-25"],
                                        extra_body=greedy)
        check(b.stop_reason in ("end_turn", "max_tokens") and text_of(b), f"{name} beta: {b}")

        # A PDF in the turn and an image in a tool result reach the real
        # server (as `file` and `image_url` parts, or as Messages blocks that
        # LiteLLM turns into parts); this text-only model's server takes no
        # content parts, and its own error comes back as the SDK's class,
        # with its message.
        before = settled_provider_calls(log)
        png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
        attached = [
            *ask,
            {"role": "assistant", "content": turn},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [
                    {"type": "text", "text": "the radar"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                "data": "JVBERi0xLjQK"}},
                {"type": "text", "text": "Summarize."}]},
        ]
        e = expect_error(anthropic.InternalServerError, 502,
                         lambda: client.messages.create(model=name, max_tokens=8, messages=attached, tools=tools),
                         f"{name} attachments")
        check("HTTP 500" in e.message and ("validation error" in e.message or "concatenate" in e.message),
              f"{name} attachments: the server's own reason: {e.message}")
        check(settled_provider_calls(log) > before, f"{name} attachments reached the server")

    # Errors, as the SDK's own classes.
    bad_key = Anthropic(base_url=edge, api_key="sk-wrong-0123456789", max_retries=0, timeout=30)
    expect_error(anthropic.AuthenticationError, 401,
                 lambda: bad_key.messages.create(model=via_messages, max_tokens=8, messages=user), "401")
    expect_error(anthropic.NotFoundError, 404,
                 lambda: client.messages.create(model="no-such-model", max_tokens=8, messages=user), "404")
    e = expect_error(anthropic.BadRequestError, 400,
                     lambda: client.messages.create(model=via_messages, max_tokens=8, messages=user,
                                                   extra_body={"temperature": 1.5}), "400")
    check("temperature" in e.message, f"400 names the field: {e.message}")
    # A 429: a key allowed one request a minute asks twice (both in the
    # same wall-clock minute).
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)
    limited = Anthropic(base_url=edge, api_key=limited_key, max_retries=0, timeout=120)
    limited.messages.create(model=model, max_tokens=4, messages=user)
    e = expect_error(anthropic.RateLimitError, 429,
                     lambda: limited.messages.create(model=model, max_tokens=4, messages=user), "429")
    check(e.body["error"]["type"] == "rate_limit_error", f"429 body {e.body}")
    check(e.response.headers.get("retry-after"), f"429: retry-after {e.response.headers}")

    # The OpenAI client against the Messages-only upstream: chat, whole and
    # streamed, translated to and from the Messages API by the node.
    oai = OpenAI(base_url=f"{edge}/v1", api_key=key, max_retries=0, timeout=120)
    r = oai.chat.completions.create(model=via_messages, messages=user, max_tokens=16, temperature=0)
    check(r.choices[0].message.content, f"openai via messages: {r}")
    check(r.choices[0].finish_reason in ("stop", "length"), f"openai via messages: finish {r.choices[0].finish_reason}")
    check(r.usage is not None and r.usage.prompt_tokens > 0, f"openai via messages: usage {r.usage}")
    text = ""
    for chunk in oai.chat.completions.create(model=via_messages, messages=user, max_tokens=16, temperature=0,
                                             stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    check(text, "openai via messages: streamed text")
    # A strict JSON schema has no place in the Messages API: a 400 naming it.
    try:
        oai.chat.completions.create(model=via_messages, messages=user, max_tokens=8,
                                    response_format={"type": "json_object"})
        raise SystemExit("FAILED: response_format via messages: no error")
    except Exception as e:  # noqa: BLE001
        check(getattr(e, "status_code", None) == 400 and "response_format" in str(e),
              f"response_format via messages: {e}")

    # The Ollama client against it too.
    oc = ollama.Client(host=edge, headers={"Authorization": f"Bearer {key}"})
    r = oc.chat(model=via_messages, messages=user, options={"num_predict": 16, "temperature": 0})
    check(r.message.content, f"ollama via messages: {r}")
    parts = [p.message.content for p in oc.chat(model=via_messages, messages=user, stream=True,
                                                options={"num_predict": 16, "temperature": 0})]
    check("".join(parts), f"ollama via messages: streamed {parts}")
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()

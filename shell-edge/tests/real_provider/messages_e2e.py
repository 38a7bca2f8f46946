"""End-to-end check of the Anthropic Messages API through an iop Edge with
real servers: the official `anthropic` SDK against the llama.cpp server
(an `openai` provider) and against LiteLLM's proxy serving the same model on
its own Messages API (an `anthropic` provider); the official `openai` and
`ollama` clients against that Messages-only upstream.

Usage: messages_e2e.py EDGE_URL API_KEY MODEL VIA_MESSAGES_MODEL

Exits non-zero (with a message) on the first failed expectation.
"""

import json
import sys

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


def main() -> None:
    edge, key, model, via_messages = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
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

        # An Idempotency-Key: the retry is the same message, replayed.
        headers = {"Idempotency-Key": f"messages-real-{name}"}
        first = client.messages.create(model=name, max_tokens=8, messages=user, extra_headers=headers)
        raw = client.messages.with_raw_response.create(model=name, max_tokens=8, messages=user, extra_headers=headers)
        again = raw.parse()
        check(raw.headers.get("idempotent-replayed") == "true", f"{name} idempotency: headers {raw.headers}")
        check(again.id == first.id and again.content == first.content, f"{name} idempotency: {first.id} vs {again.id}")

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

"""End-to-end check of an iop Edge in front of a real llama.cpp server, with
the official `openai` and `ollama` Python clients.

Usage: clients_e2e.py EDGE_URL API_KEY MODEL AS_IS_MODEL

AS_IS_MODEL routes to the same server without the node's structured-output
setting: a JSON schema reaches it as the client sent it.

Exits non-zero (with a message) on the first failed expectation.
"""

import json
import sys

import ollama
import openai
from openai import OpenAI
from pydantic import BaseModel


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


class Answer(BaseModel):
    answer: str


def main() -> None:
    edge, key, model, as_is_model = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    client = OpenAI(base_url=f"{edge}/v1", api_key=key, max_retries=0, timeout=120)
    # Greedy (temperature 0) where text is checked: a sampled answer may be
    # empty (an end-of-sequence first token), which is the model's, not ours.
    messages = [{"role": "user", "content": "Say hello in three words."}]

    models = [m.id for m in client.models.list().data]
    check(model in models, f"models list has {model}: {models}")

    # Chat, whole: the provider's own usage.
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    check(r.choices[0].message.content, "chat: content")
    check(r.usage is not None and r.usage.prompt_tokens > 0, f"chat: prompt usage {r.usage}")
    check(r.usage.completion_tokens > 0, f"chat: completion usage {r.usage}")

    # Chat, streamed: llama-cpp-python's streams carry no usage, so none is
    # reported (never zeros).
    text, usage_chunks = "", []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, stream=True, temperature=0,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if not chunk.choices:
            usage_chunks.append(chunk.usage)
    check(text, "chat stream: text")
    check(usage_chunks == [None], f"chat stream: usage is null, not invented: {usage_chunks}")

    # Responses, whole and streamed.
    r = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    check(r.output_text, "responses: text")
    check(r.usage is not None and r.usage.input_tokens > 0, f"responses: usage {r.usage}")
    events = list(client.responses.create(model=model, input="Say hello.", max_output_tokens=8, stream=True, temperature=0))
    # Eight tokens may cut the answer short: incomplete is a normal end.
    last = events[-1]
    check(last.type in ("response.completed", "response.incomplete"), f"responses stream: last {last.type}")
    check(last.response.usage is None, f"responses stream: no invented usage {last.response.usage}")

    # Stored by default (SPEC §6): the real answer is fetched and its stream
    # resumed from the journal, with no second provider call.
    rid = events[0].response.id
    got = client.responses.retrieve(rid)
    check(got.output_text == last.response.output_text, f"stored: {got.output_text!r}")
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    check([e.sequence_number for e in rest] == [e.sequence_number for e in events[3:]],
          "stored: resume after sequence number 2")
    follow = client.responses.create(model=model, input="And again.", max_output_tokens=8,
                                     previous_response_id=rid)
    check(follow.usage.input_tokens > r.usage.input_tokens, "stored: the history reached llama.cpp")
    c1 = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                        extra_headers={"Idempotency-Key": "real-provider-1"})
    c2 = client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                        extra_headers={"Idempotency-Key": "real-provider-1"})
    check(c1.id == c2.id and c1.choices[0].message.content == c2.choices[0].message.content,
          "idempotent: one answer")

    # Structured output parsed by the SDK (grammar-constrained by llama.cpp).
    parsed = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Reply with an answer."}],
        response_format=Answer, max_tokens=40,
    )
    check(isinstance(parsed.choices[0].message.parsed, Answer), f"parse: {parsed.choices[0].message}")

    # A strict JSON schema as the client sends it: the node gives it to
    # llama-cpp-python in the form that server takes (structured_output =
    # "json_object_schema"), and the answer follows the schema.
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    strict = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    ask = [{"role": "user", "content": "Reply with an answer."}]
    r = client.chat.completions.create(model=model, messages=ask, response_format=strict, max_tokens=40, temperature=0)
    obj = json.loads(r.choices[0].message.content)
    check(isinstance(obj, dict) and isinstance(obj.get("answer"), str) and set(obj) == {"answer"},
          f"json_schema: {r.choices[0].message.content!r}")

    # The same request to the server as it is: llama-cpp-python refuses the
    # json_schema form with HTTP 500, and the client learns why (the
    # provider's own message, sanitized), not just that it failed.
    try:
        client.chat.completions.create(model=as_is_model, messages=ask, response_format=strict, max_tokens=40)
        raise SystemExit("FAILED: json_schema as it is: no error")
    except openai.InternalServerError as e:
        check(e.status_code == 502, f"json_schema as it is: status {e.status_code}")
        message = e.body["message"]
        check(message.startswith("The provider returned an error (HTTP 500): "), f"as it is: {message!r}")
        check("json_object" in message, f"as it is: the provider's reason: {message!r}")
        check("\n" not in message and len(message) < 1200, f"as it is: sanitized: {message!r}")

    # llama.cpp's context-length error is a validation error of the
    # request: a 400 with its message, for both clients.
    too_long = [{"role": "user", "content": "hello " * 3000}]
    try:
        client.chat.completions.create(model=model, messages=too_long, max_tokens=8)
        raise SystemExit("FAILED: context length: no error")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"context length: status {e.status_code}")
        check("maximum context length is 2048" in e.body["message"], f"context length: {e.body}")
    oc400 = ollama.Client(host=edge, headers={"Authorization": f"Bearer {key}"})
    try:
        oc400.chat(model=model, messages=too_long, options={"num_predict": 8})
        raise SystemExit("FAILED: ollama context length: no error")
    except ollama.ResponseError as e:
        check(e.status_code == 400 and "maximum context length" in e.error, f"ollama context length: {e}")

    # Pass-through of a field the Edge does not know (llama.cpp takes top_k).
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_body={"top_k": 1})
    check(r.choices[0].message.content is not None, "top_k pass-through")

    # Embeddings (the SDK asks for base64 by default).
    e = client.embeddings.create(model=model, input=["hello", "world"])
    check(len(e.data) == 2 and len(e.data[0].embedding) > 0, "embeddings: two vectors")
    check(e.data[0].embedding != e.data[1].embedding, "embeddings: differ")

    # Text completion.
    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    check(c.choices[0].text, "completions: text")
    check(c.usage is not None and c.usage.completion_tokens > 0, f"completions: usage {c.usage}")

    # The official Ollama client against the same Edge.
    oc = ollama.Client(host=edge, headers={"Authorization": f"Bearer {key}"})
    tags = [m.model for m in oc.list().models]
    check(model in tags, f"ollama tags: {tags}")
    r = oc.chat(model=model, messages=messages, options={"num_predict": 8, "temperature": 0})
    check(r.message.content, "ollama chat: content")
    check((r.eval_count or 0) > 0 and (r.prompt_eval_count or 0) > 0, f"ollama chat: counts {r}")
    chunks = list(oc.chat(model=model, messages=messages, stream=True, options={"num_predict": 8, "temperature": 0}))
    parts = [p.message.content for p in chunks]
    check("".join(parts), f"ollama chat stream: text {chunks}")
    em = oc.embed(model=model, input=["hello"])
    check(len(em.embeddings) == 1 and len(em.embeddings[0]) > 0, "ollama embed")
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()

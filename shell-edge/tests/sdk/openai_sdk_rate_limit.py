"""The official OpenAI Python SDK against a key limited to one request in
flight (R-TEN-1): a second request raises RateLimitError with Retry-After
and the x-ratelimit-* headers; the SDK's built-in retry succeeds once the
first request has ended. Usage: openai_sdk_rate_limit.py BASE_URL KEY
"""

import sys
import threading
import time

import openai


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)


def main() -> None:
    base_url, key = sys.argv[1], sys.argv[2]
    messages = [{"role": "user", "content": "hi"}]
    first = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    # The first request streams for about two seconds and holds the slot.
    started = threading.Event()

    def hold():
        stream = first.chat.completions.create(model="m", messages=messages, stream=True)
        for _ in stream:
            started.set()

    holder = threading.Thread(target=hold)
    holder.start()
    check(started.wait(10), "the first stream started")
    try:
        first.chat.completions.create(model="m", messages=messages, max_tokens=4)
        check(False, "a second request in flight is refused")
    except openai.RateLimitError as e:
        headers = e.response.headers
        check(e.status_code == 429, "429")
        check(e.code == "rate_limit_exceeded", f"code {e.code}")
        check(int(headers["retry-after"]) >= 1, "Retry-After")
        check(headers.get("x-ratelimit-limit-requests") == "100", "x-ratelimit-limit-requests")
        check("x-ratelimit-remaining-requests" in headers, "x-ratelimit-remaining-requests")
        check("x-ratelimit-reset-requests" in headers, "x-ratelimit-reset-requests")
    # The SDK retries after Retry-After; the first request ends meanwhile.
    patient = openai.OpenAI(base_url=base_url, api_key=key, max_retries=5)
    began = time.monotonic()
    answer = patient.chat.completions.create(model="m", messages=messages, max_tokens=4)
    check(answer.choices[0].message.content, "an answer after the retry")
    check(time.monotonic() - began >= 0.5, "the answer waited for a retry")
    holder.join(30)
    print("OK")


if __name__ == "__main__":
    main()

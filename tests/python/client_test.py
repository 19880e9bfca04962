"""The real `openai` Python client against `mmserve serve`, as a vLLM user drives it:
every call parses into the client's typed objects and their fields hold what the server
means. Run by tests/e2e_openai_client.rs with two servers up:

    python client_test.py IMAGE_URL AUDIO_URL API_KEY IMAGE_PNG AUDIO_WAV

IMAGE_URL serves llava-tiny, AUDIO_URL qwen2-audio-tiny, both with --api-key API_KEY.
Exits non-zero (with the failing assertion) on the first mismatch.
"""
import base64
import sys

import json
from typing import Literal

import openai
from openai import OpenAI
from pydantic import BaseModel, Field

image_url, audio_url, key, png_path, wav_path = sys.argv[1:6]
png = base64.b64encode(open(png_path, "rb").read()).decode()
wav = base64.b64encode(open(wav_path, "rb").read()).decode()
vision = OpenAI(base_url=f"{image_url}/v1", api_key=key, max_retries=0)
audio = OpenAI(base_url=f"{audio_url}/v1", api_key=key, max_retries=0)
image_messages = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}", "detail": "high"}},
    {"type": "text", "text": "What is shown in this image?"}]}]

# Models.
models = vision.models.list()
assert [m.id for m in models.data] == ["llava-tiny"], models

# An image, greedy: a typed completion with usage and its details.
r = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
assert r.object == "chat.completion" and r.model == "llava-tiny", r
c = r.choices[0]
assert c.finish_reason == "length" and c.message.role == "assistant" and c.message.content, c
assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 45, r.usage
assert r.usage.prompt_tokens_details.cached_tokens is not None, r.usage
greedy = c.message.content

# x-request-id: ours echoed, and the raw response's headers.
raw = vision.chat.completions.with_raw_response.create(
    model="llava-tiny", messages=image_messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
    extra_headers={"x-request-id": "py-client-1"})
assert raw.headers["x-request-id"] == "py-client-1", raw.headers
assert raw.parse().choices[0].message.content == greedy

# Streaming with usage: deltas add up to the same text; the last chunk has usage only.
chunks = list(vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=8,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert text == greedy, (text, greedy)
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices

# n, seeds, logprobs.
r = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=6, temperature=1.0,
                                   n=3, seed=7, logprobs=True, top_logprobs=2)
assert [ch.index for ch in r.choices] == [0, 1, 2], r.choices
for ch in r.choices:
    lp = ch.logprobs.content
    assert len(lp) == 6 or ch.finish_reason == "stop", ch
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp
again = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=6, temperature=1.0,
                                       n=3, seed=7)
assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices], "seeded"

# stop, and logit_bias forcing a token.
r = vision.chat.completions.create(model="llava-tiny", messages=[{"role": "user", "content": "Hello"}],
                                   max_tokens=4, temperature=0, logit_bias={"42": 100},
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
assert r.choices[0].model_extra["token_ids"] == [42, 42, 42, 42], r.choices[0]
word = greedy.split()[0] if greedy.split() else greedy[:1]
r = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=8, temperature=0,
                                   stop=[word], extra_body={"ignore_eos": True})
assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].message.content, (word, r.choices[0])

# Structured output into a Pydantic model (the client sends it as a strict JSON schema).
class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)
    sure: bool


for seed in range(3):
    r = vision.chat.completions.parse(model="llava-tiny", messages=image_messages, response_format=Pick,
                                      max_tokens=60, temperature=1.0, seed=seed)
    picked = r.choices[0].message.parsed
    assert isinstance(picked, Pick) and 0 <= picked.count <= 9, r.choices[0]

# A tool-calling round trip: a required call parses into typed tool_calls whose arguments
# fit the schema, and the call and the tool's answer go back in the next request.
weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}}
r = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=200, temperature=1.0,
                                   seed=3, tools=[weather], tool_choice="required", parallel_tool_calls=False)
c = r.choices[0]
assert c.finish_reason == "tool_calls" and c.message.content is None, c
call = c.message.tool_calls[0]
assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_"), call
args = json.loads(call.function.arguments)
assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12, args
r = vision.chat.completions.create(
    model="llava-tiny", max_tokens=4, tools=[weather], tool_choice="none",
    messages=image_messages + [c.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}])
assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls, r.choices[0]
r = vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=120, tools=[weather],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
assert r.choices[0].message.tool_calls[0].function.name == "get_weather", r.choices[0]

# Errors as the client's typed exceptions.
try:
    vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=4, tools=[weather])
    raise AssertionError("tool_choice auto was accepted without a tool-call format")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["param"] == "tool_choice", e.body
try:
    vision.chat.completions.create(model="llava-tiny", messages=image_messages, max_tokens=4,
                                   prediction={"type": "content", "content": "a guess"})
    raise AssertionError("an unsupported field was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["param"] == "prediction", e.body
try:
    OpenAI(base_url=f"{image_url}/v1", api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
try:
    vision.chat.completions.create(model="other", messages=image_messages, max_tokens=4)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

# Legacy completions.
r = vision.completions.create(model="llava-tiny", prompt="Hello there", max_tokens=5, temperature=0, logprobs=2,
                              extra_body={"ignore_eos": True})
assert r.object == "text_completion" and r.choices[0].finish_reason == "length", r
assert len(r.choices[0].logprobs.tokens) == 5 and len(r.choices[0].logprobs.top_logprobs) == 5, r.choices[0].logprobs
assert r.usage.completion_tokens == 5
streamed = "".join(ch.choices[0].text for ch in vision.completions.create(
    model="llava-tiny", prompt="Hello there", max_tokens=5, temperature=0, stream=True,
    extra_body={"ignore_eos": True}) if ch.choices)
assert streamed == r.choices[0].text, (streamed, r.choices[0].text)

# Audio: input_audio with base64 WAV.
r = audio.chat.completions.create(model="qwen2-audio-tiny", max_tokens=6, temperature=0, messages=[{
    "role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                                {"type": "text", "text": "What is this sound?"}]}])
assert r.usage.prompt_tokens_details.audio_tokens > 0, r.usage
assert r.choices[0].message.content is not None
print("openai client: all checks passed")

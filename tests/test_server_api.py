"""The HTTP API's mapping of harmony replies and its errors, through the official openai client, over
a stand-in engine that replies with fixed harmony token sequences (the tiny model's replies are
random, so these are written out here)."""

import functools
import json

import urllib.error
import urllib.request
import openai
import pytest
from conftest import VOCAB, needs_vocab, until
from server_util import ScriptedEngine, serving

from gptoss_jax import tokenizer as tk
from gptoss_jax.server.app import Server, create_app

pytestmark = needs_vocab
MODEL = "gpt-oss-test"
KEY = "sk-test"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}


def harmony(text: str) -> list[int]:
    return tk.load_tokenizer(VOCAB).encode(text, allowed_special="all")


@functools.cache
def answer() -> list[int]:
    """A scripted reply: reasoning, then "Hello there!" (tokenized when first asked for: a file without
    the vocabulary is skipped, not failed at collection)."""
    return harmony("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
                   "<|message|>Hello there!<|return|>")


@functools.cache
def weather_call() -> list[int]:
    """A scripted reply: reasoning, then a call of get_weather."""
    return harmony("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                   'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>')


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(answer(), max_len=4096)


@pytest.fixture(scope="module")
def server(engine):
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL, api_key=KEY)
    server.ready.set()
    return server


@pytest.fixture(scope="module")
def url(server):
    with serving(create_app(server)) as base:
        yield base


@pytest.fixture
def client(url, engine):
    engine.reply, engine.full = answer(), False
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **kw)


def test_reasoning_and_answer_fields(client):
    r = chat(client)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, m.tool_calls) == ("The user greets me.", "Hello there!", None)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(answer())
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.reasoning_content or "" for d in deltas if hasattr(d, "reasoning_content")) == m.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(answer()) and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_legacy_functions_are_tools_answered_as_a_function_call(url, client, engine):
    """`functions` and `function_call` (before tools): the same prompt as the tools, and the call
    answered as `message.function_call` with finish reason "function_call", whole and streamed."""
    engine.reply = weather_call()
    r = raw_post(url, "/chat/completions", {**CHAT, "functions": [WEATHER["function"]]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Rome"})
    assert engine.prompts[-1] == (chat(client, tools=[WEATHER]) and engine.prompts[-1])  # as with tools
    forced = raw_post(url, "/chat/completions", {**CHAT, "functions": [WEATHER["function"]],
                                                 "function_call": {"name": "get_weather"}})
    assert forced.status_code == 200
    assert engine.prompts[-1] == (chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}) and engine.prompts[-1])
    streamed = {"name": "", "arguments": ""}
    for c in chat(client, stream=True, extra_body={"functions": [WEATHER["function"]]}):
        delta = c.choices[0].delta if c.choices else None
        if delta is not None and delta.function_call is not None:
            streamed["name"] += delta.function_call.name or ""
            streamed["arguments"] += delta.function_call.arguments or ""
        if c.choices and c.choices[0].finish_reason:
            assert c.choices[0].finish_reason == "function_call"
    assert streamed == call


def test_tool_call_fields_and_round_trip(client, engine):
    engine.reply = weather_call()
    r = chat(client, tools=[WEATHER])
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    streamed = {}
    for c in chat(client, tools=[WEATHER], stream=True):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = streamed.setdefault(d.index, {"name": None, "arguments": ""})
            entry["name"] = d.function.name or entry["name"]
            entry["arguments"] += d.function.arguments or ""
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}

    # The tool's result goes back: the prompt is what openai-harmony renders for that conversation.
    engine.reply = answer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], reasoning_effort="low")
    assert r.choices[0].message.content == "Hello there!"
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent, ToolDescription)

    tool = ToolDescription.new("get_weather", "The weather in a city", WEATHER["function"]["parameters"])
    expected = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(Role.DEVELOPER,
                                      DeveloperContent.new().with_instructions("Be brief.").with_function_tools([tool])),
        Message.from_role_and_content(Role.USER, "Weather in Rome?"),
        Message.from_role_and_content(Role.ASSISTANT, "Need the weather.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, call.function.arguments).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"celsius": 21}')
        .with_recipient("assistant").with_channel("commentary")])
    rendered = tk.harmony_encoding(VOCAB).render_conversation_for_completion(expected, Role.ASSISTANT)
    assert engine.prompts[-1] == list(rendered)


def test_responses_items_and_events(client, engine):
    r = client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user greets me." and r.output_text == "Hello there!"
    assert r.status == "completed" and r.usage.output_tokens == len(answer())
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there!"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "The user greets me."
    assert events[-1].response.output_text == "Hello there!"

    engine.reply = weather_call()
    r = client.responses.create(model=MODEL, input="Weather in Rome?",
                                tools=[{"type": "function", **WEATHER["function"]}])
    call = r.output[-1]
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Rome"})
    engine.reply = answer()
    follow = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}],
        tools=[{"type": "function", **WEATHER["function"]}])
    assert follow.output_text == "Hello there!"
    assert tk.harmony_encoding(VOCAB).decode(engine.prompts[-1]).endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}<|end|>'
        '<|start|>assistant')


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "A word's meaning",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


def streamed_calls(chunks) -> dict:
    calls = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            entry["name"] = d.function.name or entry["name"]
            entry["arguments"] += d.function.arguments or ""
    return calls


def test_a_required_or_named_tool_is_called(client, engine):
    """tool_choice "required" or a named function: the tool call's header is written for the model
    after the prompt (the whole header for one function, ` to=functions` for a choice among several),
    so the reply is that call; the header counts as prompt, the model's tokens as completion."""
    decode = tk.harmony_encoding(VOCAB).decode
    chat(client, tools=[WEATHER, LOOKUP])
    base = engine.prompts[-1]  # the prompt with tool_choice "auto"
    header = " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    engine.reply = harmony('{"city": "Oslo"}<|call|>')
    for tools, choice in (([WEATHER, LOOKUP], {"type": "function", "function": {"name": "get_weather"}}),
                          ([WEATHER], "required")):
        r = chat(client, tools=tools, tool_choice=choice)
        prompt = engine.prompts[-1]
        assert decode(prompt[len(prompt) - len(harmony(header)):]) == header
        call = r.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.reasoning_content is None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(engine.reply))
        assert streamed_calls(chat(client, tools=tools, tool_choice=choice, stream=True)) == {
            0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert engine.prompts[-3][:len(base)] == base and decode(engine.prompts[-3][len(base):]) == header

    engine.reply = harmony('.lookup<|channel|>commentary <|constrain|>json<|message|>{"word": "jax"}<|call|>')
    r = chat(client, tools=[WEATHER, LOOKUP], tool_choice="required")
    assert decode(engine.prompts[-1][len(base):]) == " to=functions"
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"word": "jax"})
    assert streamed_calls(chat(client, tools=[WEATHER, LOOKUP], tool_choice="required", stream=True)) == {
        0: {"name": "lookup", "arguments": call.function.arguments}}

    engine.reply = harmony('{"city": "Oslo"}<|call|>')
    r = client.responses.create(model=MODEL, input="Weather in Oslo?", tool_choice={"type": "function",
                                "name": "get_weather"}, tools=[{"type": "function", **WEATHER["function"]}])
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [
        ("function_call", "get_weather", {"city": "Oslo"})]


def test_cached_tokens_in_every_usage(client, engine):
    """The prompt tokens the engine found in its KV cache (request.cached_tokens) reach every usage
    object, in the shapes the openai client parses: chat and completions, plain and in the streamed
    usage chunk (prompt_tokens_details), and Responses, plain and in response.completed
    (input_tokens_details)."""
    engine.cached = 32
    try:
        assert chat(client).usage.prompt_tokens_details.cached_tokens == 32
        chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        completion = client.completions.create(model=MODEL, prompt=list(range(100)), max_tokens=3)
        assert completion.usage.prompt_tokens_details.cached_tokens == 32
        chunks = list(client.completions.create(model=MODEL, prompt=list(range(100)), max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
        assert client.responses.create(model=MODEL, input="Hi").usage.input_tokens_details.cached_tokens == 32
        events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
        assert events[-1].response.usage.input_tokens_details.cached_tokens == 32
    finally:
        engine.cached = 0
    assert chat(client).usage.prompt_tokens_details.cached_tokens == 0


def test_stop_sequences_cut_the_text(client):
    r = chat(client, stop=["there"])
    assert r.choices[0].message.content == "Hello "
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stop=["there"], stream=True)
                       if c.choices)
    assert streamed == "Hello "


class Answer:
    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text

    def json(self):
        return json.loads(self.text)


def raw_post(url, path, body, key=KEY) -> Answer:
    """POST a body as is (the openai client would refuse to send some of these)."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(url + path, data=data, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"model": MODEL, "messages": "Hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5000}, 400, "messages"),
    ({"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, 400, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "custom", "name": "x"}}, 400, "tool_choice.type"),
])
def test_bad_requests_are_answered_as_openai_does(url, client, body, status, param):
    r = raw_post(url, "/chat/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error"
    if body != "{not json" and body.get("max_tokens") == 5000:
        assert "4096" in error["message"] and "5000" in error["message"]  # both lengths said
    assert chat(client).choices[0].message.content == "Hello there!"  # and the next good request is served


def test_key_queue_and_warm_up(url, client, engine, server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert raw_post(url, "/chat/completions", {"model": MODEL, "messages": []}, key="").status_code == 401
    engine.full = True
    with pytest.raises(openai.RateLimitError):
        chat(client)
    engine.full = False
    assert [m.id for m in client.models.list()] == [MODEL]
    assert chat(client).choices[0].finish_reason == "stop"
    server.ready.clear()  # warming up: 503, and /health says so
    try:
        with pytest.raises(openai.InternalServerError) as e:
            chat(client)
        assert e.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url[:-len("/v1")] + "/health", timeout=10)
        assert e.value.code == 503
    finally:
        server.ready.set()
    with urllib.request.urlopen(url[:-len("/v1")] + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    assert chat(client).choices[0].message.content == "Hello there!"


RESPONSE = {"model": MODEL, "input": "Hi"}
COMPLETION = {"model": MODEL, "prompt": "Hi"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("path, body, param, code", [
    ("/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", None),  # needs logprobs: true
    ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/chat/completions", {**CHAT, "logit_bias": {"hello": 1}}, "logit_bias.hello", None),
    ("/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias", None),
    ("/chat/completions", {**CHAT, "logit_bias": {"201088": 1}}, "logit_bias", None),
    ("/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", None),
    ("/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty", None),
    ("/completions", {**COMPLETION, "frequency_penalty": -2.01}, "frequency_penalty", None),
    ("/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type", None),
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema", "invalid_schema"),  # a schema the grammar engine refuses
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", None),
    ("/chat/completions", {**CHAT, "functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions", None),
    ("/chat/completions", {**CHAT, "function_call": "auto"}, "function_call", None),
    ("/chat/completions", {**CHAT, "store": True}, "store", "unsupported_parameter"),
    ("/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ("/chat/completions", {**CHAT, "n": 129}, "n", None),
    ("/chat/completions", {**CHAT, "repetition_penalty": 1.1}, "repetition_penalty", "unknown_parameter"),
    ("/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", None),
    ("/completions", {**COMPLETION, "prompt": [-1], "echo": True}, "prompt[0]", None),
    ("/completions", {**COMPLETION, "prompt": [201088], "echo": True, "logprobs": 1}, "prompt[0]", None),
    ("/chat/completions", {**CHAT, "ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos", None),
    ("/completions", {**COMPLETION, "echo": 1}, "echo", None),
    ("/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of", None),
    ("/completions", {**COMPLETION, "best_of": 2, "stream": True}, "best_of", None),
    ("/completions", {**COMPLETION, "suffix": "!"}, "suffix", "unsupported_parameter"),
    ("/completions", {**COMPLETION, "logprobs": 21}, "logprobs", None),
    ("/responses", {**RESPONSE, "text": {"format": {"type": "json_schema"}}}, "text.format.schema", None),
    ("/responses", {**RESPONSE, "include": ["reasoning.encrypted_content"]}, "include[0]", None),
    ("/responses", {**RESPONSE, "background": True, "stream": True}, "background", None),
    ("/responses", {**RESPONSE, "background": True, "store": False}, "background", None),
    ("/responses", {**RESPONSE, "truncation": "auto"}, "truncation", "unsupported_parameter"),
    ("/responses", {**RESPONSE, "messages": []}, "messages", "unknown_parameter"),
])
def test_a_parameter_the_server_does_not_honour_is_refused_by_name(url, client, path, body, param, code):
    """Each of these would change the reply (or is not a parameter at all): a 400 naming it, never a
    200 that ignores it."""
    r = raw_post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error", error
    assert param in error["message"]


def test_what_asks_for_nothing_is_accepted(url, client, engine, monkeypatch):
    """The no-op values of the parameters the server does not implement, and the fields that change no
    reply, are a 200 with the same reply; vLLM's top_k and min_p reach the sampling."""
    plain = chat(client).choices[0].message.content
    r = raw_post(url, "/chat/completions", {
        **CHAT, "logprobs": False, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
        "response_format": {"type": "text"}, "n": 1, "store": False, "user": "u1", "metadata": {"k": "v"},
        "parallel_tool_calls": True, "service_tier": "auto", "modalities": ["text"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain == "Hello there!"
    assert raw_post(url, "/completions", {**COMPLETION, "echo": False, "suffix": None}).status_code == 200
    r = raw_post(url, "/responses", {**RESPONSE, "text": {"format": {"type": "text"}, "verbosity": "medium"},
                                     "store": False, "include": [], "background": False, "truncation": "disabled"})
    assert r.status_code == 200, r.text
    submitted, submit = [], engine.submit
    monkeypatch.setattr(engine, "submit", lambda ids, settings, *a, **kw: submitted.append(settings.sampling)
                        or submit(ids, settings, *a, **kw))
    chat(client, extra_body={"top_k": 5, "min_p": 0.25})
    assert (submitted[-1].top_k, submitted[-1].min_p) == (5, 0.25)
    client.responses.create(model=MODEL, input="Hi", extra_body={"top_k": -1})
    assert submitted[-1].top_k == 0  # -1 is off, as in vLLM
    assert raw_post(url, "/chat/completions", {**CHAT, "min_p": 1.0}).status_code == 400


def test_the_model_is_retrieved_by_its_name(client, url):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("openai/gpt-oss-120b")  # a name with "/" reaches the endpoint too
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.retrieve(MODEL)


@pytest.mark.parametrize("reply, cut, types", [
    (answer, -2, ["reasoning", "message"]),  # inside the answer
    (answer, 5, ["reasoning", "message"]),  # inside the reasoning (an empty answer follows it)
    (weather_call, -3, ["reasoning", "function_call"]),  # inside the call's arguments
], ids=["answer", "reasoning", "call"])
def test_the_item_that_max_output_tokens_cuts_is_incomplete(client, engine, reply, cut, types):
    """The response cut by max_output_tokens is "incomplete", and so is the item it cut, streamed and
    not; the items written whole before it are "completed"."""
    engine.reply = reply = reply()
    cut = cut % len(reply)  # from the end where negative
    kw = dict(model=MODEL, input="Hi", max_output_tokens=cut, tools=[{"type": "function", **WEATHER["function"]}])
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    cut_type = "reasoning" if cut == 5 else types[1]
    for r in (whole, streamed):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        got = [(item.type, item.status) for item in r.output]
        assert (cut_type, "incomplete") in got, got
        assert all(status == "completed" for kind, status in got if kind != cut_type), got
    assert [item.type for item in whole.output] == types
    assert {e.item.status for e in events if e.type == "response.output_item.done" and e.item.type == cut_type} \
        == {"incomplete"}
    engine.reply = answer()
    assert client.responses.create(model=MODEL, input="Hi").output[-1].status == "completed"


def test_logprobs_cover_the_answers_tokens_in_every_api(client, engine):
    """chat, Responses and completions, streamed and not, over the stand-in engine (which gives token i
    the log-probability -(i + 1) / 8): chat and Responses give the answer's tokens only (not the
    reasoning's, nor a tool call's), completions every token, the stop token included."""
    tokenizer = tk.load_tokenizer(VOCAB)
    final = answer().index(tk.load_tokenizer(VOCAB).encode("<|message|>", allowed_special="all")[0], 6) + 1
    want = [-(i + 1) / 8 for i in range(final, len(answer()) - 1)]  # "Hello there!", not <|return|>
    words = [tokenizer.decode([t]) for t in answer()[final:-1]]
    assert "".join(words) == "Hello there!"

    r = chat(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [e.logprob for e in r] == want and [e.token for e in r] == words
    assert [[t.logprob for t in e.top_logprobs] for e in r] == [[0.0, -1 / 16]] * len(want)
    assert bytes(r[0].bytes).decode() == words[0]
    streamed = chat(client, logprobs=True, stream=True)
    assert [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
        == want
    assert chat(client).choices[0].logprobs is None

    kw = dict(model=MODEL, input="Hi", include=["message.output_text.logprobs"], top_logprobs=1)
    message = client.responses.create(**kw).output[-1]
    assert [e.logprob for e in message.content[0].logprobs] == want
    assert [len(e.top_logprobs) for e in message.content[0].logprobs] == [1] * len(want)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.logprob for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs] == want
    done = [ev for ev in events if ev.type == "response.output_item.done"][-1].item
    assert [e.logprob for e in done.content[0].logprobs] == want

    lp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=50, logprobs=0).choices[0].logprobs
    assert lp.token_logprobs == [-(i + 1) / 8 for i in range(len(answer()))] and lp.top_logprobs[0] == {}
    assert lp.tokens[-1] == "<|return|>" and lp.text_offset[-1] == len("".join(lp.tokens[:-1]))  # empty text

    engine.reply = weather_call()
    r = chat(client, logprobs=True, tools=[WEATHER]).choices[0]
    assert r.finish_reason == "tool_calls" and r.logprobs.content == []


def test_a_stored_response_is_retrieved_continued_and_deleted(client, engine, url):
    """store (the default): GET /v1/responses/{id} gives the response back; previous_response_id
    continues its conversation (the prompt holds the earlier input and reply, then the new input);
    DELETE forgets it, after which both are refused; store=False keeps nothing; streamed responses
    are stored too."""
    first = client.responses.create(model=MODEL, input="What is JAX?")
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text == "Hello there!"
    second = client.responses.create(model=MODEL, input="And XLA?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = tk.harmony_encoding(VOCAB).decode(engine.prompts[-1])
    assert prompt.index("What is JAX?") < prompt.index("Hello there!") < prompt.index("And XLA?")
    third = client.responses.create(model=MODEL, input="And Pallas?", previous_response_id=second.id)
    prompt = tk.harmony_encoding(VOCAB).decode(engine.prompts[-1])
    assert prompt.index("What is JAX?") < prompt.index("And XLA?") < prompt.index("And Pallas?")
    assert third.output_text == "Hello there!"

    client.responses.delete(first.id)  # the openai client returns None: the body is checked below
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)  # gone already
    request = urllib.request.Request(f"{url}/responses/{second.id}", method="DELETE",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert json.loads(r.read()) == {"id": second.id, "object": "response", "deleted": True}
    second = client.responses.create(model=MODEL, input="And XLA?", previous_response_id=third.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert client.responses.retrieve(third.id).id == third.id  # the others stay

    unstored = client.responses.create(model=MODEL, input="Hi", store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    events = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


def test_the_store_keeps_the_latest_responses_for_their_time(monkeypatch):
    """server/store.py: at most `count` responses (the oldest goes first), each for at most `seconds`."""
    from gptoss_jax.server import store as store_module

    now = [100.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    kept = store_module.ResponseStore(count=2, seconds=60)
    for i in range(3):
        kept.put({"id": f"r{i}", "output": []}, [{"type": "message", "role": "user", "content": str(i)}])
        now[0] += 10
    assert kept.get("r0") is None and kept.get("r1").continued()[0]["content"] == "1" and len(kept) == 2
    now[0] = 100 + 10 + 60 + 1  # r1 was stored at 110: past its 60 s
    assert kept.get("r1") is None and kept.get("r2") is not None
    assert kept.delete("r2") and not kept.delete("r2") and len(kept) == 0
    # Bounded in bytes too: each kept as its JSON; the oldest go first, one larger than the cap alone is not kept.
    small = store_module.ResponseStore(count=100, seconds=60, max_bytes=1000)
    for i in range(5):
        assert small.put({"id": f"s{i}", "output": [], "blob": "x" * 400}, [])  # about 430 bytes each
    assert [small.get(f"s{i}") is not None for i in range(5)] == [False, False, False, True, True]
    assert small.stats() == {"stored_responses": 2, "stored_response_bytes": sum(
        small.get(f"s{i}").size for i in range(3, 5))} and small.stats()["stored_response_bytes"] <= 1000
    assert not small.put({"id": "big", "output": [], "blob": "x" * 1000}, []) and small.get("big") is None


def test_a_background_response_is_polled_and_cancelled(client, engine):
    """background: true answers at once (queued, no output); GET shows it until it ends, then the
    whole response; cancel ends one still running (stored as cancelled, with what it had made)."""
    r = client.responses.create(model=MODEL, input="Hi", background=True)
    assert (r.status, r.output, r.background) == ("queued", [], True)
    def ended():
        got = client.responses.retrieve(r.id)
        return got if got.status not in ("queued", "in_progress") else None

    got = until(ended, "the background response ended", 30, every=0.02)
    assert got.status == "completed" and got.output_text == "Hello there!"
    assert client.responses.cancel(r.id).status == "completed"  # ended already: as it is
    engine.reply, engine.delay = answer() * 50, 0.02
    try:
        r = client.responses.create(model=MODEL, input="Hi", background=True)
        until(lambda: engine.running and engine.running[-1].output_ids, "the background response made a token")
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(r.id).status == "cancelled"
        assert 0 < cancelled.usage.output_tokens < len(answer()) * 50
    finally:
        engine.delay = 0.0
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nonesuch")


def test_the_tokenizer_endpoints_answer_as_vllms(url):
    """POST /tokenize, /detokenize and GET /tokenizer_info (at the root, as vLLM serves them): a text's
    ids (special tokens written out read as such), with their texts on request; ids back to the text;
    a model of another name is a 404, an id outside the vocabulary a 400 naming tokens."""
    root = url.removesuffix("/v1")
    tokenizer = tk.load_tokenizer(VOCAB)
    text = "Hello<|end|> world"
    r = raw_post(root, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text, allowed_special="all")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    assert "".join(body["token_strs"]) == text and "<|end|>" in body["token_strs"]
    assert raw_post(root, "/tokenize", {"prompt": text}).json()["token_strs"] is None
    assert raw_post(root, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}
    assert raw_post(root, "/tokenize", {"model": "other", "prompt": text}).status_code == 404
    bad = raw_post(root, "/detokenize", {"tokens": [tokenizer.n_vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"
    request = urllib.request.Request(root + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as info:
        info = json.loads(info.read())
    assert info["eos_token"] == "<|return|>" and info["model_max_length"] == 4096

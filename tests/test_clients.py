"""Clients nobody on this project wrote, end to end against `gptoss-serve`'s app on the demo model
(random weights, the genuine vocabulary): LangChain's structured output by all three of its methods,
and the OpenAI Agents SDK running an agent that calls a tool, then continuing with
previous_response_id. The demo model writes no JSON and calls no tool of its own accord, so what
parses here was made to by the server's constraints."""

import asyncio
from typing import Literal

import jax.numpy as jnp
import pytest
from conftest import VOCAB, needs_vocab
from pydantic import BaseModel, Field
from server_util import serving

import gptoss_jax as gj
from gptoss_jax import tokenizer as tk
from gptoss_jax.server.app import Server, create_app
from gptoss_jax.serving import Engine
from gptoss_jax.testing import random_params

pytestmark = needs_vocab
MODEL = "gpt-oss-demo"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def url():
    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32), slots=4, max_len=1024,
                    prefill_chunk=256, prefill_rows=2, tokenizer=tk.load_tokenizer(VOCAB))
    engine.warm_up()
    engine.start()
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL)
    server.ready.set()
    try:
        with serving(create_app(server)) as base:
            yield base
    finally:
        engine.stop()


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_returns_a_parsed_object(url, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url, api_key="unused", model=MODEL, temperature=0, max_tokens=100, max_retries=0)
    if method == "json_mode":  # any JSON object (LangChain parses it to a dict)
        assert isinstance(llm.with_structured_output(None, method=method).invoke("Who?"), dict)
    else:
        assert isinstance(llm.with_structured_output(Person, method=method, strict=True).invoke("Who?"), Person)


def test_an_agents_sdk_run_calls_a_tool_and_the_next_continues_it_by_previous_response_id(url):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Literal["Rome", "Paris"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=url, api_key="unused",
                                                                        max_retries=0))
    caller = Agent(name="caller", instructions="Use the tool.", tools=[get_weather], model=model,
                   model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0.0),
                   tool_use_behavior="stop_on_first_tool")
    answerer = Agent(name="answerer", instructions="Answer.", model=model, output_type=Person,
                     model_settings=ModelSettings(max_tokens=200, temperature=0.0))

    async def run():
        first = await Runner.run(caller, "Weather in Rome?")
        return first, await Runner.run(answerer, "Who?", previous_response_id=first.last_response_id)

    first, second = asyncio.run(run())
    assert first.final_output == "sunny" and len(calls) == 1 and calls[0] in ("Rome", "Paris")
    assert isinstance(second.final_output, Person)

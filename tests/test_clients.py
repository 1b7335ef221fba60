"""Clients nobody on this project wrote, end to end against `gptoss-serve`'s app on the demo model
(random weights, the genuine vocabulary): LangChain's structured output by all three of its methods,
the OpenAI Agents SDK running an agent that calls a tool, then continuing with
previous_response_id, and lm-evaluation-harness scoring a multiple-choice task. The demo model writes no JSON and calls no tool of its own accord, so what
parses here was made to by the server's constraints."""

import asyncio
from typing import Literal

import jax.numpy as jnp
import pytest
from conftest import VOCAB, needs_vocab
from pydantic import BaseModel, Field
from server_util import serving_engine

import gptoss_jax as gj
from gptoss_jax import tokenizer as tk
from gptoss_jax.serving import Engine, EngineConfig
from gptoss_jax.testing import random_params

pytestmark = [needs_vocab, pytest.mark.optimized]  # many steps of the demo model: tests/conftest.py
MODEL = "gpt-oss-demo"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def engine():
    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32),
                    EngineConfig(slots=4, max_len=1024, prefill_chunk=256, prefill_rows=2),
                    tokenizer=tk.load_tokenizer(VOCAB))
    engine.warm_up()
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def url(engine):
    with serving_engine(engine, MODEL) as base:
        yield base


@pytest.mark.slow
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_returns_a_parsed_object(url, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url, api_key="unused", model=MODEL, temperature=0, max_tokens=100, max_retries=0)
    if method == "json_mode":  # any JSON object (LangChain parses it to a dict)
        assert isinstance(llm.with_structured_output(None, method=method).invoke("Who?"), dict)
    else:
        assert isinstance(llm.with_structured_output(Person, method=method, strict=True).invoke("Who?"), Person)


@pytest.mark.slow
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


CHOICES = [  # a task written here (no download): a question, its choices, the right one's index
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "Water freezes at", "choices": ["zero degrees", "fifty degrees"], "answer": 0},
    {"question": "The largest planet is", "choices": ["Mars", "Venus", "Jupiter"], "answer": 2},
]


@pytest.mark.slow
def test_lm_evaluation_harness_scores_a_multiple_choice_task_by_the_models_own_loglikelihoods(url, engine, tmp_path,
                                                                                             monkeypatch):
    """lm-evaluation-harness's local-completions on a task of 4 questions that this test writes (a
    JSON file and a task YAML; no download), tokenizing through the server's /tokenize (its remote
    tokenizer) and scoring each choice by completions with echo and logprobs: every choice's
    loglikelihood equals transformers' float64 log-softmax of the model's logits summed over the
    choice's tokens, within NOISE_FACTOR x the float32 run's own error; and its accuracy is the
    reference's."""
    import json

    import numpy as np
    from noise import Exact
    from refs import hf_logits

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "choices.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in CHOICES))
    (tmp_path / "gptoss_choices.yaml").write_text(f"""task: gptoss_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={url}/completions,model={MODEL},tokenizer_backend=remote,num_concurrent=1,max_retries=1",
        tasks=["gptoss_choices"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    samples = out["samples"]["gptoss_choices"]
    assert len(samples) == len(CHOICES)

    tokenizer = tk.load_tokenizer(VOCAB)
    got, ref32, ref64 = [], [], []
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            got.append(resp[0][0])
            spaces = len(context) - len(context.rstrip())  # as the harness splits a pair: spaces go with the choice
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = tokenizer.encode(context + continuation)
            n = len(tokenizer.encode(context))
            for dtype, sums in (("float32", ref32), ("float64", ref64)):
                logits = np.asarray(hf_logits(engine.config, engine.params, [whole], dtype)[0], np.float64)
                logits = logits - logits.max(-1, keepdims=True)
                logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
                sums.append(sum(logprobs[i - 1, whole[i]] for i in range(n, len(whole))))
    assert len(got) == sum(len(doc["choices"]) for doc in CHOICES)
    Exact.measure(ref32, ref64).check(got, "lm-evaluation-harness's loglikelihoods")
    # Its accuracy: the share of questions whose most likely choice (by the float64 reference) is the answer.
    scores = iter(ref64)
    right = [int(np.argmax([next(scores) for _ in sample["arguments"]])) == int(sample["target"]) for sample in samples]
    assert out["results"]["gptoss_choices"]["acc,none"] == pytest.approx(np.mean(right))

"""The grammars of structured outputs (server/structured.py) on the genuine vocabulary, through
llguidance's matcher (serving/constrain.py): which harmony replies they let through, token by token."""

import pytest
from conftest import VOCAB, needs_vocab

from gptoss_jax import tokenizer as tk
from gptoss_jax.server.structured import grammar_for, reply_grammar
from gptoss_jax.serving.constrain import Grammars

pytestmark = needs_vocab
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
          "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"]}


@pytest.fixture(scope="module")
def grammars():
    return Grammars(tk.load_tokenizer(VOCAB), 201088)


def follows(grammars, grammar: str, text: str) -> bool:
    """Whether the grammar lets the reply `text` (harmony, special tokens written out) through whole."""
    matcher = grammars.matcher(grammar)
    for token in tk.load_tokenizer(VOCAB).encode(text, allowed_special="all"):
        if not Grammars.consume(matcher, token):
            return False
    return matcher.is_accepting()


THINK = "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant"


@pytest.mark.parametrize("reply, ok", [
    ('<|channel|>final<|message|>{"name":"Ada"}<|return|>', True),
    (THINK + '<|channel|>final<|message|>{"name":"Ada"}<|return|>', True),
    (THINK + '<|channel|>final <|constrain|>json<|message|>{"name":"Ada"}<|return|>', True),
    (THINK + THINK + '<|channel|>final<|message|>{"name":"Ada"}<|return|>', False),  # one analysis message
    (THINK + '<|channel|>final<|message|>{"name": "Ada"}<|return|>', False),  # compact JSON only
    (THINK + '<|channel|>final<|message|>{"name":"Ada","age":3}<|return|>', False),  # not in the schema
    (THINK + '<|channel|>final<|message|>Ada<|return|>', False),
    (THINK + PREAMBLE + '<|channel|>final<|message|>{"name":"Ada"}<|return|>', False),  # a preamble is a call's
    (THINK + PREAMBLE + '<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>', True),
    (' to=functions.weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Rome"}<|call|>', True),
    ('<|channel|>commentary to=functions.weather<|message|>{"city":"Paris"}<|call|>', False),  # strict
    ('<|channel|>commentary to=functions.notes<|message|>anything at all<|call|>', True),  # not strict
    ('<|channel|>commentary to=functions.other<|message|>{}<|call|>', False),  # no such tool
])
def test_a_reply_grammar_lets_through_exactly_the_replies_that_follow_it(grammars, reply, ok):
    grammar = reply_grammar(answer=PERSON, tools=[("weather", CITY, True), ("notes", None, False)], budget=256)
    assert follows(grammars, grammar, reply) == ok


def test_the_reasoning_is_free_but_bounded_by_a_quarter_of_the_budget(grammars):
    """Reasoning of any text, up to a quarter of the budget rounded down to a power of two (few
    grammars for a server to compile): 10 tokens pass a budget of 80 (a cap of 16), 40 do not."""
    grammar = reply_grammar(answer=PERSON, tools=[], budget=80)
    assert grammar == reply_grammar(answer=PERSON, tools=[], budget=64)
    answer = '<|channel|>final<|message|>{"name":"A"}<|return|>'
    for words, ok in ((10, True), (40, False)):
        text = "<|channel|>analysis<|message|>" + " word" * words + "<|end|><|start|>assistant" + answer
        assert follows(grammars, grammar, text) == ok


def test_a_forced_call_is_constrained_from_where_the_server_left_it(grammars):
    """tool_choice naming a strict tool: the server wrote the call's header, the grammar takes its
    arguments; "required" among several: the name comes first. Nothing strict and no format: none."""
    named = grammar_for(None, "response_format", [("weather", CITY, True)],
                        type("Choice", (), {"name": "weather"})(), True, 100)
    assert follows(grammars, named, '{"city":"Rome"}<|call|>') and not follows(grammars, named, '{"city":"Nice"}<|call|>')
    required = grammar_for(None, "response_format", [("weather", CITY, True), ("notes", None, True)], "required",
                           True, 100)
    assert follows(grammars, required, '.weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Oslo"}<|call|>')
    assert not follows(grammars, required, '.weather<|channel|>commentary<|message|>{"town":"Oslo"}<|call|>')
    assert grammar_for(None, "response_format", [("notes", None, False)], "auto", False, 100) is None
    assert grammar_for({"type": "text"}, "response_format", [("weather", CITY, True)], "none", False, 100) is None

"""How a chat reply streams to a reader, and the timing line."""

import io

from conftest import VOCAB, needs_vocab
from gptoss_jax.cli.display import DIM, ChatPrinter, rate, timing_line


REPLY = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4 🎉<|return|>")
TOOL = ("<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>')


def _show(text, **kwargs) -> str:
    from gptoss_jax import tokenizer as tk

    enc = tk.load_tokenizer(VOCAB)
    out = io.StringIO()
    printer = ChatPrinter(enc, VOCAB, out=out, **kwargs)
    for token in enc.encode(text, allowed_special="all"):
        printer.feed(token)
    printer.finish()
    return out.getvalue()


@needs_vocab
def test_reasoning_is_set_apart_and_the_answer_plain_without_control_tokens():
    shown = _show(REPLY, color=False)
    assert shown == "[reasoning] User asks 2+2. Easy.\n\n2 + 2 = 4 🎉\n"
    assert "<|" not in shown


@needs_vocab
def test_reasoning_is_dimmed_on_a_terminal_and_can_be_hidden():
    assert _show(REPLY, color=True).startswith(f"{DIM}[reasoning] ")
    assert _show(REPLY, show_reasoning=False, color=True) == "2 + 2 = 4 🎉\n"


@needs_vocab
def test_a_tool_call_is_shown_as_a_call():
    assert _show(TOOL, color=False) == ('[reasoning] Need weather.\n'
                                        '[tool call] functions.get_weather({"city": "Paris"})\n')


@needs_vocab
def test_a_reply_cut_short_ends_its_line():
    assert _show(REPLY[:REPLY.index("Easy")], color=False) == "[reasoning] User asks 2+2. \n"


@needs_vocab
def test_a_reply_that_is_not_harmony_is_shown_raw_after_a_notice():
    shown = _show("just some words from a model with random weights " * 8, color=False)
    first, rest = shown.split("\n", 1)
    assert first == "[the reply is not in the harmony chat format; its raw text follows]"
    assert rest.startswith("just some words")


def test_rates_never_read_zero():
    assert rate(1, 40.0) == "0.025" and rate(8, 0.004) == "2,000" and rate(0, 1.0) == "n/a"
    t = {"prompt_tokens": 1, "decode_tokens": 0, "compile_s": 30.0, "prefill_s": 0.002,
         "time_to_first_token_s": 30.01, "decode_s": 0.0}
    line = timing_line(t, "n/a on cpu")
    assert "compilation 30.00 s" in line and "prefill 1 tokens in 2 ms (500 tokens/s)" in line
    assert "0.0 tokens/s" not in line and "decode: none" in line

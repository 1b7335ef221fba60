"""The OpenAI APIs' conversations in harmony, and a harmony reply back in the APIs' fields.

Prompts (`chat_prompt`, `responses_prompt`): system and developer messages become the harmony
developer message's instructions, function tools its tool list, user messages user messages; an
assistant message's reasoning goes to the `analysis` channel, its text to `final`, each of its
tool calls to `commentary` addressed to `functions.NAME` (JSON arguments), and a tool result comes
from `functions.NAME` to the assistant, as gpt-oss was trained to read them (openai-harmony renders
them; tokenizer.render_prompt).

`tool_choice`: "auto" (the default with tools) and "none" (the tools left out of the prompt) leave the
reply to the model. "required" and a named function write the start of a tool call for it, right
after `<|start|>assistant`: for a named function (or "required" with one tool) the whole header,
` to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>`, so that the model writes
only the JSON arguments; for "required" with several tools ` to=functions`, so that the model
writes the name (of one of the listed tools, as gpt-oss was trained to; nothing constrains the
name's tokens) and the rest. Either way the reply skips the reasoning channel.

Replies (`ReplyStream`): fed the generated tokens one at a time, it tells what each adds: reasoning
(the `analysis` channel), content (`final`, or a `commentary` preamble), or a tool call (a
`commentary` message to `functions.NAME`: its name, then its arguments as they stream). A reply that
is not harmony (a model with random weights, say) becomes content as raw text, as the command line
shows it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets

from .. import tokenizer as tk
from ..serving.stops import StopMatcher
from .body import check_schema
from .errors import bad_request
from .structured import format_instructions



def _text(content, param: str) -> str:
    """A message's text: a string, or text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text", "reasoning_text", "summary_text") or part.text is None:
            raise bad_request(f"only text content is supported, got a part of type {part.type!r}",
                              f"{param}[{i}].type")
        texts.append(part.text)
    return "".join(texts)


def _tool_descriptions(tools: list[tuple[str, str | None, dict | None]]):
    from openai_harmony import ToolDescription

    for i, (_, _, parameters) in enumerate(tools):
        check_schema(parameters, f"tools[{i}].parameters")
    return [ToolDescription.new(name, description or "", parameters) for name, description, parameters in tools]


def context_exceeded(max_len: int, tokens: int, at_least: bool = False) -> Exception:
    return bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                       f"{'at least ' if at_least else ''}{tokens} tokens. Please reduce the prompt or the completion "
                       f"length.", "messages", "context_length_exceeded")


# The most that the squares of the words' lengths in the text openai-harmony tokenizes itself may add
# up to (tool names, descriptions and schemas; names; texts shorter than tokenizer.VERBATIM_LEAST,
# whose longer ones tiktoken tokenizes in place): its tokenizer's time grows with the square of a
# word's length, holding Python's lock (3.6e-10 s a character squared on a CPU here), so this bounds a
# render at about 36 ms, whatever the request. Text of ordinary words stays far below it (a million
# characters of ten-letter words: 1e7).
RENDER_WORDS_MOST = 10**8


def _check_words(texts: list[str], param: str) -> None:
    """A 400 naming `param` where `texts` (those openai-harmony would tokenize itself) hold words too long
    to render in bounded time (RENDER_WORDS_MOST): counted on whitespace-separated words, which are
    never shorter than the tokenizer's pieces."""
    cost, longest = 0, 0
    for text in texts:
        for word in text.split():
            cost += len(word) ** 2
            longest = max(longest, len(word))
    if cost > RENDER_WORDS_MOST:
        raise bad_request(f"{param}: the tools' text (names, descriptions, schemas) and the messages shorter than "
                          f"{tk.VERBATIM_LEAST} characters hold words too long to render (the longest has {longest:,} "
                          f"characters)", param)


def _check_length(texts: list[str], vocab, max_len: int | None) -> None:
    """A 400 for a conversation whose texts alone exceed the context, found before it is rendered:
    openai-harmony renders holding Python's lock (about 0.1 s a MB on a CPU here, other clients
    wait), tiktoken counts without it. Cheap for conversations that fit: a text has at most as many
    tokens as UTF-8 bytes, so only conversations longer than the context in bytes are counted."""
    if max_len is None or sum(len(t) for t in texts) * 4 <= max_len:  # 4: the most bytes a character takes
        return
    if sum(len(t.encode("utf-8")) for t in texts) <= max_len:
        return
    encoder = tk.load_tokenizer(vocab)
    count = sum(len(encoder.encode_ordinary(t)) for t in texts)
    if count >= max_len:
        raise context_exceeded(max_len, count, at_least=True)


def _rendered_texts(messages, instructions: list[str], tools) -> list[str]:
    """Every text of the client's that harmony will render: instructions, messages' texts, authors'
    names and recipients, and each tool's name, description and the keys and strings of its parameters."""
    texts = list(instructions)
    for m in messages:
        texts += [part.text for part in m.content or [] if isinstance(getattr(part, "text", None), str)]
        texts += [m.recipient or "", m.author.name or ""]
    return texts + _tool_texts(tools)


def _tool_texts(tools) -> list[str]:
    return [text for name, description, parameters in tools or [] for text in (name, description or "",
                                                                               *_strings(parameters))]


def _strings(value) -> list[str]:
    """The keys and string values in JSON `value` (the text of a schema that harmony may render; its
    punctuation and numbers left out), without recursion."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            out += [k for k in v if isinstance(k, str)]
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return out


def _render(messages, *, reasoning_effort: str, instructions: list[str], tools, vocab, max_len: int | None
            ) -> list[int]:
    """tokenizer.render_prompt, with what openai-harmony refuses answered as a 400; whatever it renders
    is counted first (`_check_length`), and what openai-harmony tokenizes itself checked for words too
    long (`_check_words`)."""
    # Texts of tk.VERBATIM_LEAST characters or more are tokenized by tiktoken in place, and so counted
    # once, by the context check of the tokens (generation.settings_of); the rest openai-harmony
    # tokenizes itself: counted and checked first.
    itself = [t for t in _rendered_texts(messages, instructions, None) if len(t) < tk.VERBATIM_LEAST]
    itself += _tool_texts(tools)
    _check_length(itself, vocab, max_len)
    _check_words(itself, "tools" if tools else "messages")
    try:
        return tk.render_prompt(messages, reasoning_effort=reasoning_effort,
                                instructions="\n\n".join(t for t in instructions if t) or None,
                                tools=_tool_descriptions(tools) if tools else None, vocab=vocab)
    except (ValueError, RuntimeError) as e:
        raise bad_request(f"The conversation cannot be written in harmony: {e}") from None


@dataclasses.dataclass
class Prompt:
    """A request's prompt: the rendered conversation, and the start of the reply written for the model
    (tokens after `<|start|>assistant`: a forced tool call's header, or none)."""

    conversation: list[int]
    reply_start: list[int] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """What the engine is given."""
        return self.conversation + self.reply_start


def _tool_choice(tool_choice, names: list[str], vocab) -> tuple[bool, list[int]]:
    """(whether the tools go into the prompt, the reply's forced start) for a request's tool_choice
    (see the module docstring): a mode, or a named function (protocol.ChatToolChoice, whose name is
    `.function.name`, or protocol.ResponsesToolChoice, `.name`)."""
    if tool_choice in (None, "auto"):
        return bool(names), []
    if tool_choice == "none":
        return False, []
    if not names:
        raise bad_request(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'naming a function'} needs "
                          "function tools in 'tools'", "tool_choice")
    if tool_choice == "required":
        return True, _call_start(names[0] if len(names) == 1 else None, vocab)
    function = getattr(tool_choice, "function", None)
    name = function.name if function is not None else tool_choice.name
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    return True, _call_start(name, vocab)


def _call_start(name: str | None, vocab) -> list[int]:
    """The tokens after `<|start|>assistant` that begin a call of functions.NAME, up to its arguments,
    as openai-harmony renders them; name None: up to `functions` (the model writes `.NAME` on)."""
    rendered = tk.harmony_encoding(vocab).render(_assistant_messages("", "", [(name or "x", "{}")])[0])
    start = rendered[2:rendered.index(tk.MESSAGE) + 1]  # after <|start|> and "assistant"
    return start if name else start[:3]  # " to", "=", "functions"


def _assistant_messages(reasoning: str, text: str, calls: list[tuple[str, str]]) -> list:
    from openai_harmony import Message, Role

    out = []
    if reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    if text:
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
    for name, arguments in calls:
        out.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                   .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
    return out


def _tool_result(name: str, output: str):
    from openai_harmony import Author, Message, Role

    return (Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), output)
            .with_recipient("assistant").with_channel("commentary"))


def chat_prompt(request, vocab, max_len: int | None = None) -> Prompt:
    """The prompt of a chat completion request (protocol.ChatCompletionRequest); max_len: the context,
    checked before rendering where the texts alone exceed it."""
    from openai_harmony import Message, Role

    instructions, messages, call_names = [], [], {}
    for i, m in enumerate(request.messages):
        param = f"messages[{i}]"
        if m.role in ("system", "developer"):
            instructions.append(_text(m.content, f"{param}.content"))
        elif m.role == "user":
            messages.append(Message.from_role_and_content(Role.USER, _text(m.content, f"{param}.content")))
        elif m.role == "assistant":
            calls = []
            for call in m.tool_calls or []:
                call_names[call.id] = call.function.name
                calls.append((call.function.name, call.function.arguments))
            messages += _assistant_messages(m.reasoning_content or m.reasoning or "",
                                            _text(m.content, f"{param}.content"), calls)
        else:  # tool
            name = m.name or call_names.get(m.tool_call_id or "")
            if name is None:
                raise bad_request(f"{param}: a tool message's tool_call_id ({m.tool_call_id!r}) must name a tool call "
                                  "of an earlier assistant message", f"{param}.tool_call_id")
            messages.append(_tool_result(name, _text(m.content, f"{param}.content")))
    tools = [(t.function.name, t.function.description, t.function.parameters) for t in request.tools or []]
    with_tools, start = _tool_choice(request.tool_choice, [name for name, _, _ in tools], vocab)
    instructions.append(format_instructions(request.response_format, "response_format"))
    return Prompt(_render(messages, reasoning_effort=request.reasoning_effort or "medium", instructions=instructions,
                          tools=tools if with_tools else None, vocab=vocab, max_len=max_len), start)


def responses_prompt(request, vocab, max_len: int | None = None) -> Prompt:
    """The prompt of a Responses API request (protocol.ResponsesRequest, its items already typed)."""
    from openai_harmony import Message, Role

    instructions = [request.instructions] if request.instructions else []
    messages, call_names = [], {}
    if isinstance(request.input, str):
        messages.append(Message.from_role_and_content(Role.USER, request.input))
    for i, item in enumerate([] if isinstance(request.input, str) else request.input):
        param = f"input[{i}]"
        if item.type == "message":
            text = _text(item.content, f"{param}.content")
            if item.role in ("system", "developer"):
                instructions.append(text)
            elif item.role == "user":
                messages.append(Message.from_role_and_content(Role.USER, text))
            else:
                messages += _assistant_messages("", text, [])
        elif item.type == "reasoning":
            messages += _assistant_messages(_text(item.content or item.summary or [], f"{param}.content"), "", [])
        elif item.type == "function_call":
            call_names[item.call_id] = item.name
            messages += _assistant_messages("", "", [(item.name, item.arguments)])
        else:  # function_call_output
            name = call_names.get(item.call_id)
            if name is None:
                raise bad_request(f"{param}: call_id {item.call_id!r} names no earlier function_call",
                                  f"{param}.call_id")
            output = item.output
            messages.append(_tool_result(name, output if isinstance(output, str) else json.dumps(output)))
    tools = [(t.name, t.description, t.parameters) for t in request.tools or []]
    with_tools, start = _tool_choice(request.tool_choice, [name for name, _, _ in tools], vocab)
    effort = (request.reasoning.effort if request.reasoning else None) or "medium"
    instructions.append(format_instructions(request.text.format if request.text else None, "text.format"))
    return Prompt(_render(messages, reasoning_effort=effort, instructions=instructions,
                          tools=tools if with_tools else None, vocab=vocab, max_len=max_len), start)


@dataclasses.dataclass
class Delta:
    """What one token added: `kind` is "reasoning", "content" or "tool_call" (then `index`, the call's
    `id` and `name` on its first delta, and `text` is a piece of its JSON arguments)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


@dataclasses.dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str = ""


class ReplyStream:
    """Generated tokens in (`feed`, then `finish`), the reply's pieces out (see the module docstring).
    Stop tokens are fed too: they end the message they close. `start`: the reply's start written for
    the model (Prompt.reply_start), read first; what it says (a tool call's name) comes with the
    first token's pieces."""

    def __init__(self, tokenizer, vocab, start: list[int] = ()):
        self._reader = tk.ReplyReader(tokenizer, vocab)
        self.reasoning, self.content = [], []
        self.tool_calls: list[ToolCallOut] = []
        self._open: tuple | None = None  # (channel, recipient) of the message being read
        self.reasoning_tokens = 0  # tokens of the analysis channel's text
        self._pending: list[Delta] = []
        self._written = 0  # raw text from this token on is the model's
        self._pending = [d for token in start for d in self._read(token)]
        self._written = len(start)

    @property
    def raw(self) -> bool:
        """Whether the reply turned out not to be harmony."""
        return self._reader.raw

    @property
    def unfinished(self) -> str | None:
        """The kind of piece the reply stopped in the middle of ("reasoning", "content" or "tool_call"),
        as a reply cut short does; None when its last message was closed (or was a built-in tool's)."""
        if self.raw:
            return "content"
        if self._open is None:
            return None
        channel, recipient = self._open
        if recipient:
            return "tool_call" if recipient.startswith("functions.") else None
        return "reasoning" if channel == "analysis" else "content"

    def feed(self, token: int) -> list[Delta]:
        out, self._pending = self._pending, []
        return out + self._read(token)

    def _read(self, token: int) -> list[Delta]:
        kind = self._reader.feed(token)
        if kind == "raw":
            return self._out("content", self._reader.raw_text[-1])
        if kind == "to_raw":
            return self._to_raw()
        if kind != "content":  # a header, or a message ended
            self._open = None if kind == "end" else self._open
            return []
        channel, recipient, text = self._reader.channel, self._reader.recipient, self._reader.delta
        self.reasoning_tokens += channel == "analysis"
        out = []
        if (channel, recipient) != self._open:
            self._open = (channel, recipient)
            if recipient and recipient.startswith("functions."):
                call = ToolCallOut("call_" + secrets.token_hex(12), recipient[len("functions."):])
                self.tool_calls.append(call)
                out.append(Delta("tool_call", "", len(self.tool_calls) - 1, call.id, call.name))
        if recipient and recipient.startswith("functions."):
            self.tool_calls[-1].arguments += text
            return out + ([Delta("tool_call", text, len(self.tool_calls) - 1)] if text else [])
        if recipient:  # a built-in tool this server does not run (browser, python): not shown
            return out
        return out + self._out("reasoning" if channel == "analysis" else "content", text)

    def finish(self) -> list[Delta]:
        """The reply ended, or was cut short: what is left (a reply cut inside its first header is raw)."""
        out, self._pending = self._pending, []
        if not self.raw and self._reader.header_tokens and not (self.reasoning or self.content or self.tool_calls):
            out = self._to_raw()
        return out + (self._out("content", self._reader.flush()) if self.raw else [])

    def _out(self, kind: str, text: str) -> list[Delta]:
        if not text:
            return []
        (self.reasoning if kind == "reasoning" else self.content).append(text)
        return [Delta(kind, text)]

    def _to_raw(self) -> list[Delta]:
        self._reader.give_up()
        self.reasoning, self.content, self.tool_calls = [], [], []
        return self._out("content", "".join(self._reader.raw_text[self._written:]))


class StopTrimmer:
    """Streamed text with everything from the first stop string on cut away: text that may begin a
    stop string is held back until the next piece shows whether it does. Linear in the text however
    long the stop strings are (serving/stops.py): each character is held and handed out once."""

    def __init__(self, stops: tuple[str, ...]):
        self._matcher = StopMatcher(stops) if stops else None
        self._held: collections.deque[str] = collections.deque()  # pieces held back, in order
        self._held_len = 0
        self._given = 0  # characters handed out so far
        self.hit = False

    def add(self, text: str) -> str:
        if self._matcher is None or self.hit:
            return "" if self.hit else text
        start = self._matcher.feed(text)
        self._held.append(text)
        self._held_len += len(text)
        if start is not None:
            self.hit = True
            return self._take(start - self._given)
        return self._take(self._held_len - self._matcher.partial)

    def _take(self, n: int) -> str:
        """The first n held characters, handed out."""
        out = []
        self._given, self._held_len = self._given + n, self._held_len - n
        while n:
            piece = self._held.popleft()
            if len(piece) > n:
                self._held.appendleft(piece[n:])
                piece = piece[:n]
            out.append(piece)
            n -= len(piece)
        return "".join(out)

    def finish(self) -> str:
        return "" if self.hit else self._take(self._held_len)

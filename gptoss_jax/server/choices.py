"""The choices of a chat completion or a completion: n of them (each a generation of its own, sharing
the prompt and the client's connection: generation.py), or, for completions, the best n of `best_of`.
Each choice turns its tokens into its part of the answer, whole (`whole`) or streamed (`stream`:
SSE chunks that carry its `index`); `merged` interleaves the streams of several as their tokens come.

Choice i samples with seed + i (wrapped to 32 bits), so that it is the same request with that seed
alone, as OpenAI numbers choices from 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator, Callable

from .. import tokenizer as tk
from ..sampling import wrapped_seed
from ..serving import Settings
from . import logprobs
from .errors import APIError
from .generation import Generation, Server
from .harmony import Prompt, ReplyStream, StopTrimmer


class Failed(Exception):
    """The engine failed on this request (logged); the stream says so (`error`: how) and ends."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


def sse(data) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def finish_reason(generation: Generation, tool_calls: bool, trimmed: bool) -> str:
    reason = generation.request.finish_reason
    if generation.was_cut or (reason == "length" and not trimmed):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def seeded(settings: Settings, i: int) -> Settings:
    """Choice i's settings: seed + i, wrapped to a signed 32-bit seed."""
    return dataclasses.replace(settings, seed=wrapped_seed(settings.seed + i))


def start(server: Server, http, prompt: list[int], settings: list[Settings], rid: str, model: str,
          grammar_param: str | None = None) -> list[Generation]:
    """A generation per settings under `model` (the base's name or an adapter's), the first computing the
    prompt for the others; all or none (a refusal of one cancels those already submitted).
    grammar_param: the field that asked for their grammar."""
    out: list[Generation] = []
    try:
        for s in settings:
            out.append(Generation(server, http, prompt, s, rid, model, after=out[0] if out else None,
                                  grammar_param=grammar_param))
    except BaseException:
        for g in out:
            g.close()
        raise
    return out


def usage_of(generations: list[Generation]) -> dict:
    """OpenAI's usage of several choices: the prompt once, every choice's tokens."""
    usage = generations[0].usage()
    completion = sum(len(g.request.output_ids) for g in generations)
    return {**usage, "completion_tokens": completion, "total_tokens": usage["prompt_tokens"] + completion}


def check(generations: list[Generation], rid: str) -> bool:
    """After the choices' tokens: False when the client has gone; the error of a choice the engine failed
    (Generation.failure)."""
    if any(g.gone for g in generations):
        return False
    for g in generations:
        if (error := g.failure) is not None:
            raise error
    return True


async def merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The chunks of several streams, each as it comes (a failure in one is raised here)."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for chunk in stream:
                await queue.put(chunk)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 -- raised again by the reader
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _merge(deltas: list[dict | None]) -> list[dict]:
    """Chat deltas with the text of neighbours of one kind (content, reasoning) joined, Nones dropped."""
    out = []
    for d in deltas:
        if d is None:
            continue
        key = next(iter(d)) if len(d) == 1 and next(iter(d)) in ("content", "reasoning_content") else None
        if key and out and list(out[-1]) == [key]:
            out[-1] = {key: out[-1][key] + d[key]}
        else:
            out.append(d)
    return out


class ChatChoice:
    """One choice of a chat completion: harmony pieces to deltas and to the message. chunk(choice): the
    SSE text of a chunk holding this choice's part; legacy: the request sent `functions`, so a call
    is answered as `function_call` (its first call; finish reason "function_call"), not `tool_calls`."""

    def __init__(self, server: Server, generation: Generation, prompt: Prompt, index: int,
                 chunk: Callable[[dict], str], legacy: bool = False):
        settings = generation.request.settings
        self.generation, self.index, self._chunk, self.legacy = generation, index, chunk, legacy
        self.reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        self.trim = StopTrimmer(settings.stop_strings)
        self.answer = None if settings.logprobs is None else logprobs.Answer(
            server.tokenizer, generation.request, self.reply, tk.STOP_TOKENS)
        self.due: list[dict] = []  # log-probability entries not sent yet

    def chunk(self, delta: dict, finish: str | None = None, entries=None) -> str:
        return self._chunk({"index": self.index, "delta": delta,
                            "logprobs": None if entries is None else {"content": entries, "refusal": None},
                            "finish_reason": finish})

    def pieces(self, token: int) -> list:
        """The token's pieces, and its log-probability entry kept for the next content chunk."""
        out = self.reply.feed(token)
        if self.answer is not None:
            self.due.extend(self.answer.feed(token, out))
        return out

    def chunks_of(self, deltas: list) -> str:
        """Chat chunks for these deltas, the entries due on the first chunk with content."""
        out = []
        for d in _merge(deltas):
            entries = None
            if self.answer is not None and "content" in d and self.due:
                entries, self.due[:] = list(self.due), []
            out.append(self.chunk(d, entries=entries))
        return "".join(out)

    def as_delta(self, d) -> dict | None:
        if d.kind == "tool_call" and self.legacy:
            if d.index > 0:  # a legacy answer holds one call
                return None
            return {"function_call": {"arguments": d.text} if d.id is None else {"name": d.name, "arguments": d.text}}
        if d.kind == "tool_call":
            call = {"index": d.index, "function": {"arguments": d.text}}
            if d.id is not None:
                call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.text})
            return {"tool_calls": [call]}
        if d.kind == "reasoning":
            return {"reasoning_content": d.text}
        text = self.trim.add(d.text)
        return {"content": text} if text else None

    def finish_reason(self) -> str:
        reason = finish_reason(self.generation, bool(self.reply.tool_calls), self.trim.hit)
        return "function_call" if reason == "tool_calls" and self.legacy else reason

    async def stream(self) -> AsyncIterator[str]:
        """This choice's chunks, from its role to its finish reason."""
        yield self.chunk({"role": "assistant", "content": ""})
        async for batch in self.generation.batches():
            if text := self.chunks_of([self.as_delta(d) for token in batch for d in self.pieces(token)]):
                yield text
        if (error := self.generation.failure) is not None:
            raise Failed(error)
        finished = [self.as_delta(d) for d in self.reply.finish()]
        if self.answer is not None:
            self.due.extend(self.answer.finish())
        if text := self.chunks_of(finished):
            yield text
        if (rest := self.trim.finish()) or self.due:
            yield self.chunk({"content": rest}, entries=None if self.answer is None else list(self.due))
        yield self.chunk({}, self.finish_reason())

    async def whole(self) -> dict:
        """This choice of the whole answer (what it holds when the client has gone or it failed does not
        matter: `check` says)."""
        async for token in self.generation.tokens():
            self.pieces(token)
        self.reply.finish()
        if self.answer is not None:
            self.due.extend(self.answer.finish())
        content = self.trim.add("".join(self.reply.content)) + self.trim.finish()
        message = {"role": "assistant", "content": content or (None if self.reply.tool_calls else ""),
                   "reasoning_content": "".join(self.reply.reasoning) or None}
        if self.reply.tool_calls and self.legacy:
            call = self.reply.tool_calls[0]
            message["function_call"] = {"name": call.name, "arguments": call.arguments}
        elif self.reply.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                   "arguments": c.arguments}}
                                     for c in self.reply.tool_calls]
        return {"index": self.index, "message": message,
                "logprobs": None if self.answer is None else {"content": self.due, "refusal": None},
                "finish_reason": self.finish_reason()}


class CompletionChoice:
    """One choice of a completion: its tokens as text. chunk(choice): the SSE text of a chunk holding
    this choice's part; scored: its log-probabilities are reported (best_of computes them to rank the
    candidates either way)."""

    def __init__(self, server: Server, generation: Generation | None, index: int, chunk: Callable[[dict], str],
                 scored: bool = True, echo: tuple[str, logprobs.Completion | None] | None = None,
                 settings: Settings | None = None):
        settings = settings or generation.request.settings
        self.generation, self.index, self._chunk = generation, index, chunk
        self.decoder, self.trim = tk.StreamDecoder(server.tokenizer), StopTrimmer(settings.stop_strings)
        self.scores = None if settings.logprobs is None or not scored else logprobs.Completion(server.tokenizer)
        self.count = 0  # tokens read
        self.echo = ""  # echo: the prompt's text, written before the completion's (its tokens scored first)
        if echo is not None:
            self.echo = echo[0]
            if self.scores is not None and echo[1] is not None:
                self.scores.extend(echo[1])

    def text_of(self, token: int) -> str:  # a stop token ends the text, unwritten (its entry kept, text empty)
        i, self.count = self.count, self.count + 1
        if token in tk.STOP_TOKENS:
            if self.scores is not None:
                self.scores.add(token, self.generation.request.logprobs[i], "")
            return ""
        text = self.trim.add(self.decoder.add(token))
        if self.scores is not None:
            self.scores.add(token, self.generation.request.logprobs[i], text)
        return text

    def chunk(self, text: str, finish: str | None = None) -> str:
        return self._chunk({"index": self.index, "text": text, "logprobs": None if self.scores is None or finish
                            else self.scores.take(), "finish_reason": finish})

    def finish_reason(self) -> str:
        return finish_reason(self.generation, False, self.trim.hit)

    async def stream(self) -> AsyncIterator[str]:
        if self.echo or (self.scores is not None and self.scores.tokens):
            yield self.chunk(self.echo)  # the echoed prompt first
        if self.generation is None:  # max_tokens 0: the prompt alone
            yield self.chunk("", "length")
            return
        async for batch in self.generation.batches():
            if text := "".join(self.text_of(token) for token in batch):
                yield self.chunk(text)
        if (error := self.generation.failure) is not None:
            raise Failed(error)
        if (rest := self.trim.add(self.decoder.flush()) + self.trim.finish()) or (
                self.scores is not None and self.scores.tokens):
            yield self.chunk(rest)  # with the log-probabilities not sent yet
        yield self.chunk("", self.finish_reason())

    async def whole(self) -> dict:
        if self.generation is None:  # max_tokens 0: the prompt alone
            return {"index": self.index, "text": self.echo, "finish_reason": "length",
                    "logprobs": None if self.scores is None else self.scores.take()}
        pieces = [self.text_of(token) async for token in self.generation.tokens()]
        text = "".join(pieces) + self.trim.add(self.decoder.flush()) + self.trim.finish()
        return {"index": self.index, "text": self.echo + text, "finish_reason": self.finish_reason(),
                "logprobs": None if self.scores is None else self.scores.take()}

    def mean_logprob(self) -> float:
        """The mean log-probability of its tokens (best_of ranks by it, as OpenAI says: per token)."""
        values = [lp.logprob for lp in self.generation.request.logprobs or []]
        return sum(values) / len(values) if values else float("-inf")

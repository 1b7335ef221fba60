"""Log-probabilities in OpenAI's shapes, from the engine's (serving.TokenLogprob: a token's
log-probability after temperature and before top-k, top-p and min-p, and the most likely tokens').

- chat completions and the Responses API: a list of `{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}`, one entry per token of the answer (the `final` channel: the
  reasoning's and a tool call's tokens are not the content);
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.

A token's text is its bytes read as UTF-8 (a token that holds part of a character shows U+FFFD in
"token"; "bytes" has them exactly, as OpenAI's does).
"""

from __future__ import annotations

from ..serving import TokenLogprob
from ..tokenizer import StreamDecoder


def _text(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.decode_single_token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def token_text(tokenizer, token: int) -> str:
    """One token's own text (a character split over tokens: U+FFFD for its part)."""
    return _text(tokenizer, token)[0]


def entry(tokenizer, token: int, logprob: TokenLogprob) -> dict:
    """One token's entry of a chat or Responses `logprobs` list."""
    text, raw = _text(tokenizer, token)
    top = []
    for other, value in logprob.top:
        other_text, other_raw = _text(tokenizer, other)
        top.append({"token": other_text, "logprob": value, "bytes": other_raw})
    return {"token": text, "logprob": logprob.logprob, "bytes": raw, "top_logprobs": top}


class Completion:
    """A completion's `logprobs` object, built token by token (`add`) as its text is written."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0  # characters of text before the next token's
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token: int, logprob: TokenLogprob | None, text: str) -> None:
        """A token and `text`, what it added to the completion's text; logprob None: an echoed prompt's
        first token (nothing before it to predict it: null, as OpenAI's)."""
        self.tokens.append(_text(self.tokenizer, token)[0])
        self.token_logprobs.append(None if logprob is None else logprob.logprob)
        self.top_logprobs.append(None if logprob is None else {_text(self.tokenizer, other)[0]: value
                                                               for other, value in logprob.top})
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def extend(self, other: Completion) -> None:
        """Append another's entries (an echoed prompt's, before the completion's), offsets and all."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += [self.offset + o for o in other.text_offset]
        self.offset += other.offset

    def take(self) -> dict:
        """The object for the tokens added since the last take (a stream's chunk), or for all of them."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def echoed(tokenizer, prompt: list[int], scores) -> tuple[str, Completion | None]:
    """An echoed prompt: (its text, its tokens' `Completion` entries, or None without scores). scores:
    serving.score.prompt_logprobs's (chosen, ids, top), None for the text alone; the first token's
    entry is null (nothing predicts it, as OpenAI's)."""
    decoder, pieces = StreamDecoder(tokenizer), []
    entries = None if scores is None else Completion(tokenizer)
    for i, token in enumerate(prompt):
        pieces.append(decoder.add(token))
        if entries is not None:
            chosen, ids, top = scores
            logprob = None if i == 0 else TokenLogprob(float(chosen[i - 1]), tuple(zip(ids[i - 1].tolist(),
                                                                                         top[i - 1].tolist())))
            entries.add(token, logprob, pieces[-1])
    return "".join(pieces) + decoder.flush(), entries


class Answer:
    """Which tokens a chat or Responses reply's log-probabilities cover: those whose pieces are the
    answer's text (content deltas), or every token but the stop tokens once the reply turns out not
    to be harmony (its raw text is the answer). `feed` each token with the pieces it gave, in order."""

    def __init__(self, tokenizer, request, reply, stop_tokens):
        self.tokenizer, self.request, self.reply, self.stop_tokens = tokenizer, request, reply, stop_tokens
        self.count = 0  # tokens fed
        self.sent = 0  # a raw reply: the tokens before this one have their entries out

    def feed(self, token: int, pieces) -> list[dict]:
        """token's pieces (harmony.Delta) -> the entries to send now."""
        i, self.count = self.count, self.count + 1
        if self.reply.raw:
            return self._due()
        if any(p.kind == "content" for p in pieces):
            return [entry(self.tokenizer, token, self.request.logprobs[i])]
        return []

    def finish(self) -> list[dict]:
        """After the reply's end (ReplyStream.finish): the entries still due (a reply found raw at its end)."""
        return self._due() if self.reply.raw else []

    def _due(self) -> list[dict]:
        """A raw reply: every token fed whose entry is not out yet (all of them, when it just turned raw)."""
        start, self.sent = self.sent, self.count
        ids = self.request.output_ids
        return [entry(self.tokenizer, ids[j], self.request.logprobs[j]) for j in range(start, self.count)
                if ids[j] not in self.stop_tokens]

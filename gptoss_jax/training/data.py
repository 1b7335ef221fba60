"""Training data: JSONL conversations rendered in the harmony format, with a mask of the tokens to
learn (the assistant's), and a deterministic, resumable order of fixed-shape batches.

One conversation per line:

    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "4", "thinking": "Simple arithmetic."}]}

Roles: "system" or "developer" (instructions, rendered as harmony's developer message, as
`tokenizer.render_chat` does), "user", "assistant". An assistant message's optional "thinking" is
its analysis channel; as harmony drops earlier turns' reasoning from a prompt, only the thinking
of the replies after the last user message is kept. The model learns each assistant message's
tokens after its `<|start|>assistant` (what it generates after a prompt), the last one closed by
`<|return|>`. A line may instead be {"text": "..."}: plain text, every token learned.

Batches are [batch, max_length] (static shapes: one compilation), padded after each sequence with
mask 0. The order is a permutation of the examples per epoch, drawn from the seed and the epoch,
so a run resumed at example position p sees exactly what an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Iterator

import numpy as np

ROLES = ("system", "developer", "user", "assistant")


class DataError(ValueError):
    """Bad training data; the message names the file and line."""


@dataclasses.dataclass
class Example:
    tokens: np.ndarray  # [n] int32
    mask: np.ndarray  # [n] bool: tokens to learn


def _check_message(where: str, i: int, m) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{where}: message {i} is not an object")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise DataError(f"{where}: message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise DataError(f"{where}: message {i} ({role}) needs a string \"content\"")
    thinking = m.get("thinking")
    if thinking is not None and (role != "assistant" or not isinstance(thinking, str)):
        raise DataError(f"{where}: message {i}: \"thinking\" is a string, on assistant messages only")
    unknown = sorted(set(m) - {"role", "content", "thinking"})
    if unknown:
        raise DataError(f"{where}: message {i} has unknown field(s) {', '.join(unknown)}")
    return m


def parse_line(where: str, line: str):
    """One JSONL line -> a list of checked messages, or a str (a {"text": ...} line)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(record, dict) and set(record) == {"text"} and isinstance(record["text"], str):
        return record["text"]
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise DataError(f"{where}: expected an object with a \"messages\" list (or {{\"text\": ...}})")
    messages = [_check_message(where, i, m) for i, m in enumerate(record["messages"])]
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, so nothing to learn")
    return messages


def render(messages: list[dict], encoding) -> Example:
    """Harmony tokens of a conversation and the mask of the assistant's tokens."""
    from openai_harmony import DeveloperContent, Message, Role, SystemContent

    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    parts: list[tuple[list[int], bool]] = [(encoding.render(Message.from_role_and_content(Role.SYSTEM, SystemContent.new())),
                                            False)]
    replies = []
    for i, m in enumerate(messages):
        if m["role"] in ("system", "developer"):
            content = DeveloperContent.new().with_instructions(m["content"])
            parts.append((encoding.render(Message.from_role_and_content(Role.DEVELOPER, content)), False))
        elif m["role"] == "user":
            parts.append((encoding.render(Message.from_role_and_content(Role.USER, m["content"])), False))
        else:
            if m.get("thinking") and i > last_user:
                thought = Message.from_role_and_content(Role.ASSISTANT, m["thinking"]).with_channel("analysis")
                replies.append(len(parts))
                parts.append((encoding.render(thought), True))
            replies.append(len(parts))
            answer = Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel("final")
            parts.append((encoding.render(answer), True))
    if messages[-1]["role"] == "assistant":  # the conversation's last reply ends it: <|return|>
        tokens, _ = parts[replies[-1]]
        return_token = encoding.encode("<|return|>", allowed_special="all")[0]
        parts[replies[-1]] = (tokens[:-1] + [return_token], True)
    tokens, mask = [], []
    for part, learn in parts:
        tokens += part
        # <|start|>assistant is the prompt's; the model generates from the channel on.
        mask += [False] * min(2, len(part)) + [True] * (len(part) - 2) if learn else [False] * len(part)
    return Example(np.asarray(tokens, np.int32), np.asarray(mask, bool))


def _plain(text: str, encoding) -> Example:
    tokens = np.asarray(encoding.encode(text, allowed_special=set()), np.int32)
    return Example(tokens, np.ones(tokens.shape, bool))


def read_jsonl(path: str, encoding, *, max_length: int, warn=print) -> list[Example]:
    """Every line of a JSONL file as an Example; errors name the file and line. Conversations longer
    than max_length are cut to it (one warning says how many), and dropped if nothing to learn is
    left within it."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: data file not found")
    examples, cut, dropped = [], 0, 0
    with open(path, encoding="utf-8") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = parse_line(f"{path}:{number}", line)
        example = _plain(parsed, encoding) if isinstance(parsed, str) else render(parsed, encoding)
        if len(example.tokens) > max_length:
            cut += 1
            example = Example(example.tokens[:max_length], example.mask[:max_length])
            if not example.mask[1:].any():
                dropped += 1
                continue
        examples.append(example)
    if cut:
        warn(f"{path}: {cut} of {len(examples) + dropped} conversations are longer than --max-length {max_length} "
             f"tokens and were cut to it" + (f"; {dropped} with nothing to learn left were dropped" if dropped else ""))
    if not examples:
        raise DataError(f"{path}: no conversations to train on" + (" (the file is empty)" if not any(
            line.strip() for line in lines) else ""))
    return examples


def batch(examples: list[Example], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples -> (tokens [n, length] int32, mask [n, length] bool), padded with token 0, mask 0."""
    tokens = np.zeros((len(examples), length), np.int32)
    mask = np.zeros((len(examples), length), bool)
    for i, e in enumerate(examples):
        tokens[i, : len(e.tokens)] = e.tokens
        mask[i, : len(e.mask)] = e.mask
    return tokens, mask


@functools.lru_cache(maxsize=4)
def order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The examples' order in an epoch: a permutation drawn from (seed, epoch) alone."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batches(examples: list[Example], *, batch_size: int, length: int, seed: int,
            position: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Endless (position after the batch, tokens [batch_size, length], mask, tokens not padding)
    from example `position` on (counted across epochs), in the epochs' orders."""
    n = len(examples)
    while True:
        picked = []
        for p in range(position, position + batch_size):
            epoch, offset = divmod(p, n)
            picked.append(examples[order(n, seed, epoch)[offset]])
        position += batch_size
        yield (position, *batch(picked, length), sum(min(len(e.tokens), length) for e in picked))

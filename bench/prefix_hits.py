"""How much of each turn's prompt the paged KV cache's prefix reuse can serve, for conversations rendered in
harmony exactly as the server renders them (CPU only, no model: token sequences are compared, nothing runs).

    python bench/prefix_hits.py [--tokenizer PATH] [--pages 16,64,128] [--per-turn]

Each turn is a chat completion request (protocol.ChatCompletionRequest, through harmony.chat_prompt, as the
server reads it) holding the whole conversation so far as a client sends it back: earlier replies' final
text and tool calls, without their reasoning unless the shape says so. What the model generated is taken
to be its reply in harmony's own form, after the prompt's `<|start|>assistant`:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`,
or `...<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>`
for a tool call (openai-harmony's rendering of the same messages, with `<|return|>` for a final answer's
`<|end|>`). The cache then holds every earlier prompt and every earlier prompt + reply (less the reply's
last token, whose KV is never computed); nothing is evicted. A turn reuses the longest common prefix with
any of them, in whole pages of P tokens, at most (prompt length - 1) rounded down to P (the last prompt
token is always computed): scheduler.cached_prefix. Hit rate: reused / prompt tokens, over all turns
and over turns 2+ (the first turn finds nothing of its own conversation cached).

Shapes (synthetic lorem-like text, fixed seeds, lengths drawn uniformly from the ranges):
- chat: 8 turns; system message ~2,000 tokens; user messages 100-300 tokens; replies analysis 100-200
  + final 200-300 tokens.
- chat, no reasoning: the same texts, replies final only.
- agent: system ~700 tokens + 6 tools (`tools`; ~2,050 tokens rendered in all, harmony's own header
  included) and a user task; 8 rounds of analysis (100-200) + a tool call, each answered by a tool
  result of 200-500 tokens; then a final answer (analysis + final), then a follow-up user task whose
  reply is analysis + a tool call: 10 requests. The client resends each call (`tool_calls`), not its
  reasoning.
- agent, reasoning resent: the same with each reply's reasoning sent back (`reasoning_content`), which
  harmony keeps until a final answer follows it.
The note tells whether each prompt is a token prefix of the next one, and where the first reply
stops matching the next prompt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # openai-harmony and tiktoken: one core is plenty
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from gptoss_jax import tokenizer as tk  # noqa: E402
from gptoss_jax.server import harmony  # noqa: E402
from gptoss_jax.server.protocol import ChatCompletionRequest  # noqa: E402

VOCAB = os.path.normpath(os.path.join(ROOT, "..", "shared", "tokenizer", tk.VOCAB_FILE))  # as tests/conftest.py
WORDS = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore et "
         "dolore magna aliqua enim ad minim veniam quis nostrud exercitation ullamco laboris nisi aliquip ex ea "
         "commodo consequat duis aute irure in reprehenderit voluptate velit esse cillum eu fugiat nulla pariatur "
         "excepteur sint occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est "
         "laborum").split()


class Text:
    """Deterministic lorem-like text of about n tokens."""

    def __init__(self, encoder, seed: int):
        self.encoder, self.rng = encoder, random.Random(seed)

    def __call__(self, n: int | tuple[int, int]) -> str:
        n = self.rng.randint(*n) if isinstance(n, tuple) else n
        words = [self.rng.choice(WORDS) + self.rng.choice(["", "", "", "", ",", "."]) for _ in range(n)]
        return self.encoder.decode(self.encoder.encode_ordinary(" ".join(words).capitalize())[:n])


def reply_tokens(encoding, reasoning: str, text: str, calls: list[tuple[str, str]]) -> list[int]:
    """What the model generated after `<|start|>assistant` (see the module docstring)."""
    tokens = [t for m in harmony._assistant_messages(reasoning, text, calls) for t in encoding.render(m)][2:]
    return tokens[:-1] + [tk.RETURN] if text and not calls else tokens


def chat(text: Text, encoding, reasoning: bool = True):
    """(messages, tools, the reply generated) per turn."""
    messages = [{"role": "system", "content": text(2000)}]
    for _ in range(8):
        messages.append({"role": "user", "content": text((100, 300))})
        thought, answer = text((100, 200)), text((200, 300))
        yield messages, None, reply_tokens(encoding, thought if reasoning else "", answer, [])
        messages = messages + [{"role": "assistant", "content": answer}]


def agent(text: Text, encoding):
    """The same for the agent loop (each reply's reasoning kept in its message: prompt_tokens drops it)."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": text(120),
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": text(20)},
            "limit": {"type": "integer", "description": text(20)},
            "mode": {"type": "string", "enum": ["fast", "full"], "description": text(20)}}}}} for i in range(6)]
    messages = [{"role": "system", "content": text(700)}, {"role": "user", "content": text((100, 300))}]
    for step in range(10):
        thought = text((100, 200))
        if step == 8:  # the final answer, then a follow-up task
            answer = text((200, 300))
            yield messages, tools, reply_tokens(encoding, thought, answer, [])
            messages = messages + [{"role": "assistant", "content": answer, "reasoning_content": thought},
                                   {"role": "user", "content": text((100, 300))}]
            continue
        name, args = f"tool_{step % 6}", json.dumps({"query": text((10, 40)), "limit": step + 3})
        yield messages, tools, reply_tokens(encoding, thought, "", [(name, args)])
        call = {"id": f"call_{step}", "type": "function", "function": {"name": name, "arguments": args}}
        messages = messages + [{"role": "assistant", "tool_calls": [call], "reasoning_content": thought},
                               {"role": "tool", "tool_call_id": f"call_{step}", "content": text((200, 500))}]


def prompt_tokens(messages, tools, resend_reasoning: bool, vocab: str) -> list[int]:
    if not resend_reasoning:
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    body = {"model": "gpt-oss-20b", "messages": messages} | ({"tools": tools} if tools else {})
    return harmony.chat_prompt(ChatCompletionRequest.model_validate(body), vocab).tokens


def reusable(n: int, lcp: int, P: int) -> int:
    """Tokens of an n-token prompt served from the cache, given its longest common prefix with a cached one."""
    return min(lcp, n - 1) // P * P


def common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def measure(turns, resend_reasoning: bool, vocab: str, encoding):
    """-> (per turn (prompt tokens, longest cached common prefix), the divergence note)."""
    cached, rows, prompts, replies = [], [], [], []
    for messages, tools, reply in turns:
        prompt = prompt_tokens(messages, tools, resend_reasoning, vocab)
        rows.append((len(prompt), max((common(prompt, s) for s in cached), default=0)))
        cached += [prompt, prompt + reply[:-1]]
        prompts.append(prompt)
        replies.append(reply)
    show = lambda tokens, i: repr(encoding.decode(tokens[i:i + 1]))  # noqa: E731
    notes = []
    for k in range(1, len(prompts)):
        i = common(prompts[k - 1], prompts[k])
        if i < len(prompts[k - 1]):
            notes.append(f"prompt {k} not a prefix of prompt {k + 1}: token {i} of {len(prompts[k - 1])} "
                         f"{show(prompts[k - 1], i)} -> {show(prompts[k], i)}")
            break
    else:
        notes.append("each prompt is a prefix of the next")
    full, n = prompts[0] + replies[0], len(prompts[0])
    j = common(full, prompts[1])
    notes.append(f"all of reply 1 ({len(replies[0])} tokens) is in prompt 2" if j == len(full) else
                 f"reply 1 leaves prompt 2 at its token {j - n + 1} of {len(replies[0])}: "
                 f"{show(full, j)} -> {show(prompts[1], j)}")
    return rows, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=VOCAB, help="o200k_base.tiktoken (default: %(default)s)")
    parser.add_argument("--pages", default="16,64,128", help="page sizes P (default: %(default)s)")
    parser.add_argument("--per-turn", action="store_true", help="also print every turn's prompt and reuse")
    args = parser.parse_args()
    vocab, sizes = tk.find_vocab(args.tokenizer), [int(p) for p in args.pages.split(",")]
    encoder, encoding = tk.load_tokenizer(vocab), tk.harmony_encoding(vocab)
    shapes = {"chat": (chat, 0, False), "chat, no reasoning": (functools.partial(chat, reasoning=False), 0, False),
              "agent": (agent, 1, False), "agent, reasoning resent": (agent, 1, True)}
    results = {name: measure(shape(Text(encoder, seed), encoding), resend, vocab, encoding)
               for name, (shape, seed, resend) in shapes.items()}

    print("| shape | P | turns | prompt tokens | reused | hit rate | hit rate, turns 2+ | prefixes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, (rows, note) in results.items():
        for P in sizes:
            reused = [reusable(n, lcp, P) for n, lcp in rows]
            total, later = sum(n for n, _ in rows), sum(n for n, _ in rows[1:])
            print(f"| {name} | {P} | {len(rows)} | {total:,} | {sum(reused):,} | {sum(reused) / total:.1%} | "
                  f"{sum(reused[1:]) / later:.1%} | {note if P == sizes[0] else 'same'} |")
    if args.per_turn:
        print("\n| shape | turn | prompt tokens | common prefix |" + "".join(f" reused, P={P} |" for P in sizes))
        print("|---|---:|---:|---:|" + "---:|" * len(sizes))
        for name, (rows, _) in results.items():
            for k, (n, lcp) in enumerate(rows, 1):
                print(f"| {name} | {k} | {n:,} | {lcp:,} |" + "".join(f" {reusable(n, lcp, P):,} |" for P in sizes))


if __name__ == "__main__":
    main()

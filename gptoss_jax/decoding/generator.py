"""Generation: chunked prefill into a static KV cache, then jitted decode calls with the cache donated.

    gen = Generator(config, params, max_len=4096)
    for result in gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, sampling=Sampling(temperature=0)):
        print(result.output_ids)

Prompts are right-padded to a shared length rounded up to a power of two (at least 16), then
processed in chunks of at most `prefill_chunk` tokens per sequence (512, or 4096 with a fused
attention kernel) and `prefill_tokens` for the whole batch (attention's and the experts' temporaries
grow with both), so a new prompt length inside a bucket compiles nothing new. Decode runs
`decode_steps` steps per jitted call (a loop on the devices, which also stops sequences at their
stop tokens), so the host dispatches once per that many tokens; it reads each call's tokens for
streaming and stop checks with the next call already queued. Sequences that stop no longer grow
(their cache length stays put).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import numpy as np

from .. import fp8
from ..config import ModelConfig
from ..drafts.base import GIVEN, Draft, on_devices
from ..model.cache import init_cache
from ..model.transformer import Kernels
from ..sampling import Sampling, rows_mode
from ..sharding import mesh_of, on_every_device, replicated, to_host_soon
from ..weight import Params
from .checked import CheckedSteps, Plan, checked_steps, row_settings
from .steps import Decode, Model, decode, follow, pick_first, prefill


@dataclasses.dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (a stop token, included in output_ids) or "length"
    timings: dict


def batch_timings(results: Sequence[Result]) -> dict:
    """The batch's figures from its results' own timings: all prompt tokens over the shared prefill,
    and all decoded tokens over the time until the last sequence finished."""
    t = results[0].timings  # compile_s, prefill_s and time_to_first_token_s are the batch's
    prompt = sum(r.timings["prompt_tokens"] for r in results)
    decoded = sum(r.timings["new_tokens"] - 1 for r in results)  # the first token came from prefill
    decode_s = max(r.timings["decode_s"] for r in results)
    return {
        "compile_s": t["compile_s"],
        "time_to_first_token_s": t["time_to_first_token_s"],
        "prompt_tokens": prompt,
        "prefill_s": t["prefill_s"],
        "prefill_tokens_per_s": prompt / t["prefill_s"],
        "decode_tokens": decoded,
        "decode_s": decode_s,
        "decode_tokens_per_s": decoded / decode_s if decoded and decode_s > 0 else None,
    }


@dataclasses.dataclass
class _Replies:
    """A batch's replies as the host has them while they are generated: each sequence's tokens so
    far, which go on, and `add(sequence, token, time)`, which keeps, streams and checks a token."""

    prompts: Sequence[Sequence[int]]
    outputs: list[list[int]]
    active: np.ndarray
    add: Callable[[int, int, float], None]
    max_new_tokens: int


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class Generator:
    """Generates for batches of prompts with one set of parameters and a static cache length.

    Each compiled step (a prefill chunk shape, the first tokens' pick, the decode call) is compiled
    ahead of time once and kept, so that timings can tell compilation from prefill and decode, and
    a new prompt length inside a bucket compiles nothing new. `decode_steps`: decode steps per call
    to the devices (a loop there; the tokens do not depend on it). `kv_dtype`: the cache's storage,
    "bf16" or "fp8" (e4m3 with a power-of-two scale per vector, fp8.py); None: the activations' dtype.
    """

    def __init__(self, config: ModelConfig, params: Params, *, max_len: int, kernels: Kernels = Kernels(),
                 prefill_chunk: int | None = None, prefill_tokens: int = 8192, decode_steps: int = 8,
                 kv_dtype: str | None = None):
        if max_len > config.max_context_length:
            raise ValueError(f"max context {max_len} exceeds the model's {config.max_context_length}")
        self.config, self.params, self.max_len, self.kernels = config, params, max_len, kernels
        self.dtype = params["embedding"].dtype
        self.kv_dtype = fp8.cache_dtype(kv_dtype, self.dtype)  # the cache's storage: "bf16", "fp8" (fp8.py), None: dtype
        if prefill_chunk is None:  # fused attention holds no [chunk, keys] scores: fewer, larger steps
            prefill_chunk = kernels.prompt_chunk(self.dtype)
        if decode_steps < 1:
            raise ValueError(f"decode steps per call must be >= 1, got {decode_steps}")
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.decode_steps = decode_steps
        self.mesh = mesh_of(params)  # parameters laid out on a mesh: the cache and every step follow
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self._compile_s = 0.0
        self._placed: tuple = (None, None)  # the last draft head drafted with, and its arrays placed here

    def _compiled(self, fn, statics: tuple, args: tuple):
        """fn's executable for these static arguments and argument shapes, compiled once.

        The key holds the shapes of the array arguments only: the parameters are this Generator's,
        and the cache's shapes follow from the batch size, which the token arrays carry. Hashing
        those two pytrees (hundreds of leaves) on every decode call would cost milliseconds.
        """
        key = (fn.__name__, statics,
               tuple((a.shape, a.dtype) for a in jax.tree.leaves([a for a in args if not isinstance(a, dict)])))
        if key not in self.executables:
            start = time.perf_counter()
            self.executables[key] = fn.lower(*statics, *args).compile()
            self._compile_s += time.perf_counter() - start
        return self.executables[key]

    def _arrays(self, draft) -> dict:
        """A draft head's arrays where the parameters are (on their mesh: replicated), placed once."""
        if self._placed[0] is not draft:
            self._placed = (draft, self._replicated(draft.arrays()))
        return self._placed[1]

    def _replicated(self, tree):
        """Arrays on this Generator's devices: on its mesh, a copy on every device; else as they are."""
        return tree if self.mesh is None else jax.device_put(tree, replicated(self.mesh))

    def _call(self, fn, statics: tuple, *args):
        return self._compiled(fn, statics, args)(*args)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, stop_tokens: Sequence[int] = (),
                 on_token: Callable[[int, int], None] | None = None, draft: Draft | None = None,
                 draft_tokens: int = 4) -> list[Result]:
        """Generate for a batch of prompts (lists of token ids); on_token(sequence, token) streams.

        Each result's `timings` are its own: prompt and new tokens, the batch's compilation and
        prefill (shared), its time to first token, and its decode time and rate up to its last token.

        `draft`: speculative decoding (decoding/checked.py): each step checks up to `draft_tokens` tokens
        that draft(context, k) proposes; greedy, the tokens are those without it (up to the rounding
        of a pass over several positions); sampled, they are drawn from the same distributions (with
        other draws, row b seeded seed + b). The timings then count the drafted tokens and the
        accepted ones kept. A `drafts.base.DeviceDraft` (hashable: a static argument) drafts on the
        devices, several steps a call; so does an EAGLE-3 head (`drafts.eagle3.Eagle3Draft`), which
        follows every step of the target from the prompt's first chunk on.
        """
        B = len(prompts)
        lengths = np.array([len(p) for p in prompts])
        if B == 0 or lengths.min() == 0:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max new tokens must be >= 1, got {max_new_tokens}")
        if not -2**31 <= seed < 2**31:
            raise ValueError(f"the seed must be a 32-bit signed integer, got {seed}")
        if lengths.max() + max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {lengths.max()} tokens plus {max_new_tokens} new tokens exceeds the "
                             f"max context of {self.max_len}")
        vocab = self.config.vocab_size
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if draft is not None:
            ring = min(self.config.sliding_window, self.max_len)
            if not 1 <= draft_tokens < ring:
                raise ValueError(f"draft tokens per step must lie in [1, {ring - 1}] (the sliding layers' ring "
                                 f"holds {ring} positions), got {draft_tokens}")

        self._compile_s = 0.0
        start_time = time.perf_counter()
        padded = min(_bucket(int(lengths.max())), self.max_len)
        # The largest power of two (at least 16) that keeps batch x chunk within prefill_tokens.
        per_sequence = max(16, 1 << max(self.prefill_tokens // B, 1).bit_length() - 1)
        chunk = min(self.prefill_chunk, per_sequence, padded)
        padded = -(-padded // chunk) * chunk
        tokens = np.zeros((B, padded), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = p
        put = functools.partial(on_every_device, mesh=self.mesh)
        settings = tuple(put(x) for x in row_settings(sampling, seed, B))  # row b seeded seed + b
        mode = rows_mode([sampling])
        cache = init_cache(self.config, B, self.max_len, self.kv_dtype, mesh=self.mesh)
        last = put(np.zeros(B, np.int32))  # each row's latest token, on the devices
        stateful = on_devices(draft) and bool(draft.capture)  # (an EAGLE-3 head)
        model = Model(self.config, self.kernels, self.mesh, draft.capture if stateful else ())
        head = None
        if stateful:  # its own cache beside the target's, following every step from the prompt's on
            head = (self._arrays(draft), draft.init_state(B, (B, self.max_len), self.mesh))
        for start in range(0, padded, chunk):
            counts = np.clip(lengths - start, 0, chunk)
            finishing = (counts > 0) & (start + counts == lengths)  # the chunk holds the prompt's last token
            plan = np.stack([np.arange(B), counts, np.minimum(start, lengths), finishing, np.zeros(B)]).astype(np.int32)
            logits, cache, step = self._call(prefill, (model,), self.params, cache, put(tokens[:, start:start + chunk]),
                                             put(plan))
            if finishing.any():  # the first tokens of the prompts this chunk ends (sampling step 0)
                _, last = self._call(pick_first, (self.mesh, mode), logits, last, put(plan), settings)
            if head is not None:
                head = (head[0], self._call(follow, (model, draft), self.params, head[0], head[1], step,
                                            put(np.arange(B, dtype=np.int32))))
        token_dev = last  # stays on the devices as the next step's input
        to_host_soon(token_dev)
        token = np.asarray(token_dev)  # the host copy: stop checks and streaming
        first_token_time = time.perf_counter()
        prefill_compile_s = self._compile_s

        stops = set(int(t) for t in stop_tokens)
        outputs: list[list[int]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        finished = np.full(B, np.nan)  # when each sequence produced its last token
        active = np.ones(B, bool)
        taken = 0  # steps whose tokens the host has read (the first from the prompt's logits)

        def add(b: int, token: int, now: float) -> None:
            """Sequence b's next token: kept, streamed, checked for a stop and for its last."""
            outputs[b].append(token)
            finished[b] = now
            if on_token:
                on_token(b, token)
            if token in stops:
                active[b], reasons[b] = False, "stop"
            elif len(outputs[b]) == max_new_tokens:
                active[b] = False

        def take(tokens: np.ndarray) -> bool:
            """One step's tokens [B] read on the host: kept, streamed, checked for stops. -> whether
            any sequence goes on."""
            nonlocal taken
            taken += 1
            now = time.perf_counter()
            for b in np.nonzero(active)[0]:
                add(int(b), int(tokens[b]), now)
            return bool(active.any()) and taken < max_new_tokens

        # The decode calls' other inputs stay on the devices: the plan (lengths, sampling steps,
        # budgets) comes back from each call, which stops sequences itself.
        is_stop = np.zeros(vocab, bool)
        is_stop[[t for t in stops if 0 <= t < vocab]] = True
        is_stop_dev = put(is_stop)
        plan = np.stack([np.arange(B), lengths, np.where(active, 1, -1), np.full(B, max_new_tokens - 1)])
        carry = (cache, token_dev, put(plan.astype(np.int32)))  # the cache, the latest tokens, the plan
        spec = Decode(Model(self.config, self.kernels, self.mesh), self.decode_steps, mode)

        def queue_call(carry):  # the next decode call on the devices, not waited for
            cache, last, plan = carry
            new_dev, last, plan, cache = self._call(decode, (spec,), self.params, cache, last, plan, settings,
                                                    is_stop_dev)
            to_host_soon(new_dev)
            return new_dev, (cache, last, plan)

        # The first token is streamed before the decode call compiles. From then on the next call is
        # queued before this call's tokens are read, so the devices run calls back to back while the
        # host reads, streams and checks for stops (tokens past a sequence's stop or its last are in
        # no output: a call may run steps that no sequence needs, and once every sequence has stopped
        # the call queued after is waited for, so that its time is not the next generation's).
        going = take(token)
        if draft is not None:
            drafted, accepted = self._speculate(_Replies(prompts, outputs, active, add, max_new_tokens), token_dev,
                                                cache, draft, draft_tokens,
                                                (settings, mode, is_stop_dev), head)
        calls = -(-(max_new_tokens - 1) // self.decode_steps) if going and draft is None else 0
        pending = queue_call(carry) if calls else None  # (tokens [steps, B], carry) of the oldest call
        while pending is not None:
            new_dev, carry = pending
            calls -= 1
            pending = queue_call(carry) if calls else None
            for tokens in np.asarray(new_dev):
                going = take(tokens)
                if not going:
                    break
            if not going:
                break
        jax.block_until_ready(pending)  # a call queued past the last token: the devices finish it here
        decode_compile_s = self._compile_s - prefill_compile_s
        prefill_s = first_token_time - start_time - prefill_compile_s
        results = []
        for b, p in enumerate(prompts):
            decoded = len(outputs[b]) - 1  # tokens from decode steps (the first came from prefill)
            decode_s = max(finished[b] - first_token_time - decode_compile_s, 0.0) if decoded else 0.0
            timings = {
                "batch_size": B,
                "prompt_tokens": len(p),
                "new_tokens": len(outputs[b]),
                "compile_s": self._compile_s,
                "prefill_s": prefill_s,
                "prefill_tokens_per_s": len(p) / prefill_s,
                "time_to_first_token_s": first_token_time - start_time,
                "decode_s": decode_s,
                "decode_tokens_per_s": decoded / decode_s if decoded and decode_s > 0 else None,
            }
            if draft is not None:
                timings.update(drafted_tokens=int(drafted[b]), accepted_tokens=int(accepted[b]))
            results.append(Result(list(map(int, p)), outputs[b], reasons[b], timings))
        return results

    def _speculate(self, replies: _Replies, last, cache, draft: Draft, k: int, rows: tuple, head=None):
        """The decode loop with drafts, through the checked steps (decoding/checked.py): drafts made on
        the devices (`drafts.base.DeviceDraft`; head: an EAGLE-3 head's arrays and its state after the
        prefill) run `decode_steps` steps a call, the next call queued
        before this one's tokens are read, as in plain decoding; drafts made on the host run a step a
        call, each drafted from the tokens so far. rows: the rows' sampling settings and mode, and the
        stop tokens, on the devices. -> (tokens drafted [B], accepted [B])."""
        prompts, outputs, active, add = replies.prompts, replies.outputs, replies.active, replies.add
        max_new_tokens = replies.max_new_tokens
        B, vocab = len(prompts), self.config.vocab_size
        put = functools.partial(on_every_device, mesh=self.mesh)
        host = not on_devices(draft)
        steps = 1 if host else self.decode_steps
        settings, mode, is_stop_dev = rows
        spec = CheckedSteps(Model(self.config, self.kernels, self.mesh), GIVEN if host else draft, k, steps,
                            modes=(mode,))  # the batch's one mode: a smaller program than the engine's
        lengths = np.array([len(p) + len(o) - 1 for p, o in zip(prompts, outputs)], np.int32)  # positions cached
        budget = np.where(active, [max_new_tokens - len(o) for o in outputs], 0)
        plan = np.stack([np.arange(B), lengths, budget, [len(o) for o in outputs], np.zeros(B), np.zeros(B)])
        history = None
        if not host and draft.reads_history:  # (an EAGLE-3 head drafts from its own state)
            history = np.zeros((B, self.max_len), np.int32)
            for b, p in enumerate(prompts):
                history[b, :len(p) + len(outputs[b])] = [*p, *outputs[b]]
            history = put(history)
        arrays, state = None, None
        if head is not None:  # an EAGLE-3 head: its arrays, and its state after the prefill
            arrays, state = head
        elif not host and draft.arrays() is not None:
            arrays = self._replicated(draft.arrays())
        carry = (cache, history, last, put(plan.astype(np.int32)),
                 put(np.array([steps, 0, 0], np.int32)), state)  # the spec's one mode
        drafted, accepted = np.zeros(B, int), np.zeros(B, int)

        def given() -> dict:
            """The host's drafts for a step: up to k a row, no more than its reply still needs."""
            drafts, counts = np.zeros((B, k), np.int32), np.zeros(B, np.int32)
            for b in np.nonzero(active)[0]:
                room = min(k, max_new_tokens - len(outputs[b]) - 1)  # the step's own token counts too
                proposed = list(draft(list(prompts[b]) + outputs[b], room))[:room] if room > 0 else []
                if any(not 0 <= t < vocab for t in proposed):
                    raise ValueError(f"the draft proposed token ids outside [0, {vocab}): {proposed}")
                drafts[b, :len(proposed)], counts[b] = proposed, len(proposed)
            return {"drafts": put(drafts), "counts": put(counts)}

        def queue_call(carry):  # the next call on the devices, not waited for
            cache, history, last, rows, run, state = carry
            outcome, cache, history, last, state = self._call(
                checked_steps, (spec,), self.params, cache, history, last, Plan(rows, run, settings, is_stop_dev),
                given() if host else arrays, state)
            for x in outcome[:5]:
                to_host_soon(x)
            return outcome, (cache, history, last, outcome.rows, outcome.run, state)

        # Each step gives every going sequence a token at least: so many calls finish every reply.
        calls = -(-(max_new_tokens - 1) // steps) if active.any() else 0
        pending = queue_call(carry) if calls else None
        while pending is not None:
            outcome, carry = pending
            calls -= 1
            pending = queue_call(carry) if calls and not host else None
            new, counts, n, kept, ran = (np.asarray(x) for x in outcome[:5])
            now = time.perf_counter()
            for s in range(int(ran)):
                for b in np.nonzero(counts[s])[0]:
                    if not active[b]:
                        raise RuntimeError(f"sequence {b} got tokens on the devices after it ended on the host")
                    drafted[b] += n[s, b]
                    accepted[b] += kept[s, b]
                    for t in new[s, b, :counts[s, b]]:
                        add(int(b), int(t), now)
            if not active.any():
                jax.block_until_ready(pending)  # a call queued past the last token: its steps run nothing
                pending = None
            elif host and calls:
                pending = queue_call(carry)
        if active.any():
            raise RuntimeError("speculative decoding ended on the devices before the replies did")
        return drafted, accepted

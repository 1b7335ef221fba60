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
import jax.numpy as jnp
import numpy as np

from .cache import init_cache
from .config import ModelConfig
from .model import Kernels, Transformer
from .sampling import Sampling, sample
from .sharding import everywhere, mesh_of, on_every_device, replicated, to_host_soon, zeros_on_devices
from .decoding.checked import CheckedSteps, Plan, checked_steps, mode_index, row_settings
from .drafts.base import GIVEN, Draft, on_devices
from .eagle3 import captured, init_head_cache
from .eagle3_draft import Eagle3Draft, head_prefill
from .weight import Params


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


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh", "capture"), donate_argnames=("cache",))
def _prefill_chunk(config, kernels, mesh, capture, params, tokens, cache, last, lengths, start):
    """Prompt positions [start, start + T) of every sequence, tokens [B, T]; lengths [B]: the prompts'
    lengths (positions past them are padding). -> (logits of each prompt's last token [B, V], kept in
    `last` until the chunk holding it, cache; with `capture`, those layers' outputs [B, T, G])."""
    T = tokens.shape[1]
    valid = (start + jnp.arange(T))[None] < lengths[:, None]  # [B, T]
    last_index = lengths - 1
    i = jnp.clip(last_index - start, 0, T - 1)
    here = (last_index >= start) & (last_index < start + T)
    model = Transformer(config, kernels=kernels, mesh=mesh, capture=capture)
    if not capture:
        picked, cache = model.apply({"params": params}, tokens, cache, valid, logits_at=i)
        return everywhere(jnp.where(here[:, None], picked, last), mesh), cache
    (picked, cache), state = model.apply({"params": params}, tokens, cache, valid, logits_at=i, mutable=["intermediates"])
    return everywhere(jnp.where(here[:, None], picked, last), mesh), cache, captured(state, capture)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh", "sampling", "steps"),
                   donate_argnames=("cache",))
def _decode(config, kernels, mesh, sampling, steps, params, tokens, active, is_stop, limit, cache, seed, step):
    """`steps` decode steps in one call, each sampling from the last: tokens [B] the last tokens, active
    [B] the sequences still going, is_stop [V] the stop tokens, limit: the step counter's bound (the
    step counted `limit` and later ones, a call's surplus past the tokens asked for, run with every
    sequence inactive, so the cache never grows past its end, where a kernel would read beyond it).

    -> (the new tokens [steps, B], the last of them [B], active, cache, step + steps). On the
    devices, a sequence stops after a stop token (which it keeps), so the host reads tokens once per
    call, not per step: one dispatch and one transfer for `steps` tokens. Step `step + i` samples with its own key, so the
    tokens do not depend on `steps`."""
    model = Transformer(config, kernels=kernels, mesh=mesh)

    def one(carry, i):  # one decode step: the last tokens in, the next ones out
        tokens, active, cache = carry
        valid = active & (step + i < limit)
        logits, cache = model.apply({"params": params}, tokens[:, None], cache, valid[:, None])
        tokens = everywhere(sample(logits[:, 0], _step_key(seed, step + i), sampling), mesh)
        return (tokens, valid & ~is_stop[tokens], cache), tokens

    (tokens, active, cache), new = jax.lax.scan(one, (tokens, active, cache), jnp.arange(steps, dtype=jnp.int32))
    return (everywhere(new, mesh), everywhere(tokens, mesh), everywhere(active, mesh), cache,
            everywhere(step + steps, mesh))


@functools.partial(jax.jit, static_argnames=("mesh", "sampling"))
def _sample(mesh, sampling, logits, seed):
    return everywhere(sample(logits, _step_key(seed, 0), sampling), mesh)


def _step_key(seed, step):
    """Step `step`'s sampling key: jax.random.key(seed) folded with the step, made inside the jitted
    steps (an eager jax.random.key costs the host milliseconds, and no key crosses to the host)."""
    return jax.random.fold_in(jax.random.key(seed), step)


class Generator:
    """Generates for batches of prompts with one set of parameters and a static cache length.

    Each compiled step (a prefill chunk shape, the decode call, the first sampling) is compiled
    ahead of time once and kept, so that timings can tell compilation from prefill and decode, and
    a new prompt length inside a bucket compiles nothing new. `decode_steps`: decode steps per call
    to the devices (a loop there; the tokens do not depend on it).
    """

    def __init__(self, config: ModelConfig, params: Params, *, max_len: int, kernels: Kernels = Kernels(),
                 prefill_chunk: int | None = None, prefill_tokens: int = 8192, decode_steps: int = 8):
        if max_len > config.max_context_length:
            raise ValueError(f"max context {max_len} exceeds the model's {config.max_context_length}")
        self.config, self.params, self.max_len, self.kernels = config, params, max_len, kernels
        self.dtype = params["embedding"].dtype
        if prefill_chunk is None:  # fused attention holds no [chunk, keys] scores: fewer, larger steps
            prefill_chunk = kernels.prompt_chunk(self.dtype)
        if decode_steps < 1:
            raise ValueError(f"decode steps per call must be >= 1, got {decode_steps}")
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.decode_steps = decode_steps
        self.mesh = mesh_of(params)  # parameters laid out on a mesh: the cache and every step follow
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self._compile_s = 0.0
        self._head: tuple = (None, None)  # the last EAGLE-3 head drafted with, and its arrays placed here

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

    def _head_arrays(self, draft: Eagle3Draft) -> dict:
        """An EAGLE-3 head's arrays where the parameters are (on their mesh: replicated), placed once."""
        if self._head[0] is not draft:
            self._head = (draft, self._replicated(draft.arrays()))
        return self._head[1]

    def _replicated(self, tree):
        """Arrays on this Generator's devices: on its mesh, a copy on every device; else as they are."""
        return tree if self.mesh is None else jax.device_put(tree, replicated(self.mesh))

    def _call(self, fn, statics: tuple, *args):
        return self._compiled(fn, statics, args)(*args)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, stop_tokens: Sequence[int] = (),
                 on_token: Callable[[int, int], None] | None = None, draft: Draft | Eagle3Draft | None = None,
                 draft_tokens: int = 4) -> list[Result]:
        """Generate for a batch of prompts (lists of token ids); on_token(sequence, token) streams.

        Each result's `timings` are its own: prompt and new tokens, the batch's compilation and
        prefill (shared), its time to first token, and its decode time and rate up to its last token.

        `draft`: speculative decoding (decoding/checked.py): each step checks up to `draft_tokens` tokens
        that draft(context, k) proposes; greedy, the tokens are those without it (up to the rounding
        of a pass over several positions); sampled, they are drawn from the same distributions (with
        other draws, row b seeded seed + b). The timings then count the drafted tokens and the
        accepted ones kept. A `drafts.base.DeviceDraft` (hashable: a static argument) drafts on the
        devices, several steps a call; so does an EAGLE-3 head (`eagle3_draft.Eagle3Draft`), from
        the hidden states the prefill and each checked step capture.
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
        seed_dev = put(np.int32(seed))  # the sampling key is made from it inside the jitted steps
        cache = init_cache(self.config, B, self.max_len, self.dtype, mesh=self.mesh)
        last = zeros_on_devices(jax.ShapeDtypeStruct((B, vocab), jnp.float32),
                                None if self.mesh is None else replicated(self.mesh))
        model = (self.config, self.kernels, self.mesh)
        lengths_dev = put(lengths.astype(np.int32))
        eagle = isinstance(draft, Eagle3Draft)
        if eagle:  # the head's cache follows the prompt: its states at p with the token at p + 1
            capture, following = draft.config.aux_layers, np.zeros_like(tokens)
            following[:, :-1] = tokens[:, 1:]
            arrays = self._head_arrays(draft)
            head_cache = self._replicated(init_head_cache(draft.config, B, self.max_len, self.dtype))
            pending = self._replicated(jnp.zeros((B, len(capture) * self.config.hidden_size), self.dtype))
        for start in range(0, padded, chunk):
            chunk_tokens = put(tokens[:, start:start + chunk])
            if not eagle:
                last, cache = self._call(_prefill_chunk, model + ((),), self.params, chunk_tokens, cache, last,
                                         lengths_dev, put(np.int32(start)))
                continue
            last, cache, states = self._call(_prefill_chunk, model + (capture,), self.params, chunk_tokens, cache,
                                             last, lengths_dev, put(np.int32(start)))
            before_last = put((start + np.arange(chunk))[None] < (lengths - 1)[:, None])
            head_cache, pending = self._call(head_prefill, (draft, self.mesh, self.kernels), arrays["head"],
                                             self.params["embedding"], put(following[:, start:start + chunk]), states,
                                             before_last, head_cache, pending, put((lengths - 1).astype(np.int32)),
                                             put(np.int32(start)))
        # Stays on the devices as the next step's input.
        token_dev = self._call(_sample, (self.mesh, sampling), last, seed_dev)
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

        # The decode calls' other inputs stay on the devices: the active mask and the step counter
        # come back from each call, which stops sequences itself.
        is_stop = np.zeros(vocab, bool)
        is_stop[[t for t in stops if 0 <= t < vocab]] = True
        is_stop_dev, limit_dev = put(is_stop), put(np.int32(max_new_tokens))
        carry = (token_dev, put(active), cache, put(np.int32(1)))  # the last tokens, active, cache, step

        def queue_call(carry):  # the next decode call on the devices, not waited for
            token_dev, active_dev, cache, step_dev = carry
            new_dev, *carry = self._call(
                _decode, model + (sampling, self.decode_steps), self.params, token_dev, active_dev, is_stop_dev,
                limit_dev, cache, seed_dev, step_dev)
            to_host_soon(new_dev)
            return new_dev, tuple(carry)

        # The first token is streamed before the decode call compiles. From then on the next call is
        # queued before this call's tokens are read, so the devices run calls back to back while the
        # host reads, streams and checks for stops (tokens past a sequence's stop or its last are in
        # no output: a call may run steps that no sequence needs, and once every sequence has stopped
        # the call queued after is waited for, so that its time is not the next generation's).
        going = take(token)
        if draft is not None:
            drafted, accepted = self._speculate(prompts, outputs, active, add, token_dev, cache, draft, draft_tokens,
                                                max_new_tokens, sampling, seed, is_stop_dev,
                                                (arrays, head_cache, pending) if eagle else None)
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

    def _speculate(self, prompts, outputs, active, add, last, cache, draft: Draft, k: int, max_new_tokens: int,
                   sampling: Sampling, seed: int, is_stop_dev, head=None):
        """The decode loop with drafts, through the checked steps (decoding/checked.py): drafts made on
        the devices (`drafts.base.DeviceDraft`; head: an EAGLE-3 head's arrays, its cache and the
        prompts' last states after the prefill) run `decode_steps` steps a call, the next call queued
        before this one's tokens are read, as in plain decoding; drafts made on the host run a step a
        call, each drafted from the tokens so far. -> (tokens drafted [B], accepted [B])."""
        B, vocab = len(prompts), self.config.vocab_size
        put = functools.partial(on_every_device, mesh=self.mesh)
        host = not on_devices(draft)
        steps = 1 if host else self.decode_steps
        spec = CheckedSteps(self.config, self.kernels, self.mesh, GIVEN if host else draft, k, steps)
        lengths = np.array([len(p) + len(o) - 1 for p, o in zip(prompts, outputs)], np.int32)  # positions cached
        budget = np.where(active, [max_new_tokens - len(o) for o in outputs], 0)
        plan = np.stack([np.arange(B), lengths, budget, [len(o) for o in outputs], np.zeros(B), np.zeros(B)])
        settings = tuple(put(x) for x in row_settings(sampling, seed, B))
        history = None
        if not host:
            history = np.zeros((B, self.max_len), np.int32)
            for b, p in enumerate(prompts):
                history[b, :len(p) + len(outputs[b])] = [*p, *outputs[b]]
            history = put(history)
        arrays, state = None, None
        if head is not None:  # an EAGLE-3 head: its arrays, and its state after the prefill
            arrays, state = head[0], draft.start(*head[1:], last, put(active), k)
        elif not host and draft.arrays() is not None:
            arrays = self._replicated(draft.arrays())
        carry = (cache, history, last, put(plan.astype(np.int32)),
                 put(np.array([steps, 0, mode_index([sampling])], np.int32)), state)
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

"""Continuous batching: a fixed number of slots in one static KV cache, each request admitted as
soon as a slot frees up.

    engine = Engine(config, params, slots=8, max_len=4096)
    engine.start()                                    # a thread runs the steps
    request = engine.submit([1, 2, 3], Settings(max_new_tokens=32))
    for token in request.tokens():
        print(token)
    engine.stop()

Each step of the engine (`step`):
1. frees the slots of cancelled requests, and admits waiting requests into free slots (FIFO);
2. prefills one chunk (at most `prefill_chunk` prompt tokens) of each of the earliest admitted
   requests still prefilling, up to `prefill_rows` of them together; a chunk holding a prompt's
   last token also samples that request's first token;
3. decodes one token for every slot past its prompt, each sampled by its own settings;
4. reads the tokens of the step before (the device meanwhile runs this one), hands them to their
   requests, and finishes the requests that reach a stop token, a stop string or their token
   budget.

Each decode step takes the slots' latest tokens from the step before on the devices, so the host
never waits for a step before queueing the next: the device runs steps back to back while the
host streams. A request that meets a stop token is computed one step more, and that token dropped.

So a long prompt delays the others' next token by one chunk at most. Shapes never change with the
traffic (the cache is [slots, max_len], a prefill [1 or prefill_rows, prefill_chunk], a decode
step [slots]), so nothing compiles after `warm_up`. On a mesh the slots are split over `data`, as
`Generator`'s batch is.

With several processes (jax.distributed), process 0 takes the requests and sends each step's
admissions and cancellations to the others, which run the same steps with `follow()`
(lockstep.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ..cache import init_cache
from ..config import ModelConfig
from ..kernels import Kernels
from ..sampling import MODES, rows_mode
from ..sharding import mesh_of, on_every_device, to_host_soon
from ..tokenizer import StreamDecoder
from ..weight import Params
from . import steps
from .lockstep import Lockstep, LockstepError, Message
from .metrics import Metrics
from .request import QueueFull, Request, Settings
from .stops import StopMatcher


@dataclasses.dataclass
class _Slot:
    request: Request
    prefilled: int = 0  # prompt tokens sent to the cache
    queued: int = 0  # tokens sampled on the devices so far, read or not (the next one's sampling step)
    decoder: StreamDecoder | None = None  # the reply as text, token by token, for stop strings
    stops: StopMatcher | None = None  # its stop strings, looked for in that text


class Engine:
    """Serves many concurrent requests on one set of parameters (see the module's docstring)."""

    def __init__(self, config: ModelConfig, params: Params, *, slots: int = 8, max_len: int = 4096,
                 prefill_chunk: int = 256, prefill_rows: int = 4, max_waiting: int = 1024, kernels: Kernels = Kernels(),
                 tokenizer=None):
        if max_len > config.max_context_length:
            raise ValueError(f"max context {max_len} exceeds the model's {config.max_context_length}")
        if min(slots, prefill_chunk, prefill_rows) < 1 or max_waiting < 0:
            raise ValueError("slots, prefill_chunk and prefill_rows must be positive, max_waiting at least 0")
        self.config, self.params, self.kernels, self.tokenizer = config, params, kernels, tokenizer
        self.slots, self.max_len, self.prefill_chunk, self.max_waiting = slots, max_len, prefill_chunk, max_waiting
        # Prompts prefilled together: one alone, or up to prefill_rows (two compiled shapes).
        self.prefill_shapes = sorted({1, min(prefill_rows, slots)})
        self.mesh = mesh_of(params)
        self._cache = init_cache(config, slots, max_len, params["embedding"].dtype, mesh=self.mesh)
        self._last = self._put(np.zeros(slots, np.int32))  # each slot's latest token, on the devices
        self._in_flight: list = []  # the step before's (tokens on the devices, [(row, slot, _Slot)])
        self._slots: list[_Slot | None] = [None] * slots
        self._admitted: list[int] = []  # slots in the order their requests were admitted
        self._waiting: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.metrics = Metrics()
        self.compiled: list[str] = []
        self._slot_settings = None  # the decode step's per-slot sampling settings on the devices, kept
        # until a slot changes hands (they change only then; only the steps array changes every step)
        self._lockstep = Lockstep.of_this_process()  # None: one process
        self._lost: str | None = None  # why the other processes were lost (then nothing more is taken)

    # The Python API ------------------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], settings: Settings = Settings(),
               listener: Callable[[int | None], None] | None = None) -> Request:
        """Queue a request; QueueFull at once when `max_waiting` requests already wait beyond those the
        free slots take at the next step, ValueError for a prompt the engine cannot take (empty, ids
        outside the vocabulary, too long). `listener`: called on the engine's thread with each token,
        then None when the request finishes (request.py)."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt) + settings.max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus {settings.max_new_tokens} new tokens exceeds the "
                             f"max context of {self.max_len}")
        if settings.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer=...))")
        if self._following:
            raise RuntimeError(f"process {self._lockstep.process_index} follows process 0: submit requests there")
        if self._lost is not None:
            raise RuntimeError(f"the engine stopped: {self._lost}")
        with self._lock:
            # A request that finds a slot free is taken whatever max_waiting says: it waits only until
            # the next step.
            free = sum(s is None for s in self._slots)
            if len(self._waiting) >= self.max_waiting + free:
                self.metrics.rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this engine queues ({self.max_waiting} "
                                f"beyond the {free} slots free)")
            request = Request(next(self._ids), prompt, settings, listener)
            self._waiting.append(request)
            self._wake.notify()
        return request

    def stats(self) -> dict:
        with self._lock:
            used = sum(s is not None for s in self._slots)
            prefilling = sum(1 for s in self._slots if s is not None and s.prefilled < len(s.request.prompt_ids))
            state = {"running": used, "prefilling": prefilling, "waiting": len(self._waiting), "slots_in_use": used,
                     "slots": self.slots}
        return self.metrics.snapshot(**state)

    @property
    def alive(self) -> bool:
        """Whether the engine's thread (`start`) is running and can take requests: False before start,
        after stop, and after a failure it cannot recover from (the other processes lost, say)."""
        return self._thread is not None and self._thread.is_alive() and self._lost is None and not self._stopping

    @property
    def _following(self) -> bool:
        return self._lockstep is not None and not self._lockstep.leader

    def start(self) -> None:
        """Run the steps on a thread of their own until `stop` (process 0 of several: the others run
        `follow`)."""
        if self._following:
            raise RuntimeError("a process other than 0 runs follow(), not start()")
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="gptoss-engine", daemon=True)
            self._thread.start()

    def stop(self, cancel: bool = True) -> None:
        """Stop taking steps: cancel=True cancels every request not yet finished (their slots are freed
        at once); cancel=False lets them finish first."""
        with self._lock:
            if cancel:
                for r in list(self._waiting) + [s.request for s in self._slots if s is not None]:
                    r.cancel()
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        else:
            self.run_until_idle()
        if self._lockstep is not None and self._lockstep.leader and self._lost is None:
            self._lockstep.send(Message(stop=True))

    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 runs, as it sends them, until it stops
        (LockstepError if it is lost)."""
        if not self._following:
            raise RuntimeError("follow() runs on processes other than 0 of several")
        while not self._stopping:
            try:
                self.step()
            except LockstepError:
                raise
            except Exception as e:  # as process 0 does (`_run`): the step failed there as well
                self._fail_running(f"{type(e).__name__}: {e}")

    def warm_up(self) -> list[str]:
        """Compile the steps (nothing is generated, no slot changes) and say what was compiled."""
        S, C = self.slots, self.prefill_chunk
        outputs = []
        for P in self.prefill_shapes:
            for mode in MODES:
                outputs.append(self._prefill_call([None] * P, np.zeros((P, C), np.int32), [0] * P, [False] * P, mode))
        for mode in MODES:
            self._slot_settings = (*self._sampling_arrays([None] * S), mode)
            outputs.append(self._decode_call(np.full(S, -1, np.int32)))
        self._slot_settings = None
        for x in outputs:
            np.asarray(x)
        self.compiled = [f"prefill [{P}, {C}]" for P in self.prefill_shapes] + [
            f"decode step [{S}]", f"token picks ({', '.join(MODES)}) [{', '.join(map(str, self.prefill_shapes + [S]))}]",
            f"KV cache [{S}, {self.max_len}]"]
        return self.compiled

    def run_until_idle(self) -> None:
        """Run steps on this thread until nothing is waiting or running (tests, batch jobs)."""
        while self.step():
            pass

    # The steps ---------------------------------------------------------------------------------------------

    @property
    def _model(self):
        return self.config, self.kernels, self.mesh

    def _put(self, x):
        return on_every_device(x, self.mesh)

    def _sampling_arrays(self, requests: Sequence[Request | None]):
        """(seeds, temperature, top_k, top_p, min_p) on the devices, a row per request (None: an idle
        row, greedy)."""
        n = len(requests)
        out = {"seed": np.zeros(n, np.int32), "temperature": np.zeros(n, np.float32), "top_k": np.zeros(n, np.int32),
               "top_p": np.ones(n, np.float32), "min_p": np.zeros(n, np.float32)}
        for i, r in enumerate(requests):
            if r is None:
                continue
            s = r.settings.sampling
            out["seed"][i], out["temperature"][i], out["top_k"][i] = r.settings.seed, s.temperature, s.top_k
            out["top_p"][i], out["min_p"][i] = s.top_p, s.min_p
        return tuple(self._put(out[k]) for k in ("seed", "temperature", "top_k", "top_p", "min_p"))

    def step(self) -> bool:
        """One engine step (see the module's docstring); False when there was nothing to do."""
        if self._following:
            message = self._lockstep.receive()
            if message.stop:
                self._stopping = True
                return False
            self._apply(message)
        else:
            with self._lock:
                cancelled = self._free_cancelled()
                admitted = self._admit()
                if self._lockstep is not None:
                    self._lockstep.send(Message(cancelled, [(s, self._slots[s].request) for s in admitted]))
        queued = []
        prefilling = [s for s in self._admitted if self._slots[s].prefilled < len(self._slots[s].request.prompt_ids)]
        if prefilling:
            queued.append(self._prefill(prefilling))
        decoding = [s for s in self._admitted
                    if 0 < self._slots[s].queued < self._slots[s].request.settings.max_new_tokens]
        if decoding:
            queued.append(self._decode(decoding))
        before, self._in_flight = self._in_flight, queued
        for tokens, rows in before:  # read while the device runs this step's work
            self._read(tokens, rows)
        return bool(queued or before)

    def _free(self, slot: int, reason: str) -> None:
        request = self._slots[slot].request
        self._slots[slot] = None
        self._slot_settings = None
        self._admitted.remove(slot)
        request._finish(reason, time.perf_counter())
        self.metrics.finish(request)

    def _free_cancelled(self) -> list[int]:
        """Drop cancelled requests -> the slots freed, in order."""
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            r._finish("cancelled", time.perf_counter())
            self.metrics.finish(r)
        freed = [slot for slot in self._admitted if self._slots[slot].request.cancelled]
        for slot in freed:
            self._free(slot, "cancelled")
        return freed

    def _admit(self) -> list[int]:
        """Waiting requests into free slots -> the slots filled."""
        filled = []
        for slot in range(self.slots):
            if self._slots[slot] is None and self._waiting:
                self._take(slot, self._waiting.popleft())
                filled.append(slot)
        return filled

    def _take(self, slot: int, request: Request) -> None:
        self._slots[slot] = _Slot(request)
        self._slot_settings = None
        self._admitted.append(slot)
        self.metrics.prompt_tokens += len(request.prompt_ids)

    def _apply(self, message: Message) -> None:
        """A follower: process 0's decisions for this step."""
        for slot in message.cancel:
            self._free(slot, "cancelled")
        for slot, request in message.admit:
            if self._slots[slot] is not None:
                raise LockstepError(f"process {self._lockstep.process_index} differs from process 0: slot {slot} is "
                                    f"still taken here")
            self._take(slot, request)

    def _prefill_call(self, slots: list[int | None], tokens: np.ndarray, counts: list[int], finishing: list[bool],
                      mode: str):
        """prefill_slots and pick_first for these rows (None: a padding row) -> their first tokens
        [P] on the devices."""
        index = self._put(np.array([self.slots if s is None else s for s in slots], np.int32))
        resets = np.array([s is not None and self._slots[s].prefilled == 0 for s in slots])
        logits, self._cache = steps.prefill_slots(*self._model, self.params, self._cache, index, self._put(tokens),
                                                  self._put(np.array(counts, np.int32)), self._put(resets))
        sampling = self._sampling_arrays([None if s is None else self._slots[s].request for s in slots])
        first, self._last = steps.pick_first(self.mesh, mode, logits, self._last, index,
                                             self._put(np.array(finishing)), *sampling)
        return first

    def _prefill(self, prefilling: list[int]):
        """Queue one chunk of each of the first prefilling slots (in admission order) -> (first tokens
        on the devices, the rows whose prompts it ends)."""
        P = self.prefill_shapes[-1] if len(prefilling) > 1 else 1
        rows: list[int | None] = prefilling[:P] + [None] * (P - len(prefilling[:P]))
        C = self.prefill_chunk
        tokens, counts, finishing = np.zeros((P, C), np.int32), [0] * P, [False] * P
        for i, slot in enumerate(rows):
            if slot is not None:
                state = self._slots[slot]
                chunk = state.request.prompt_ids[state.prefilled:state.prefilled + C]
                tokens[i, :len(chunk)], counts[i] = chunk, len(chunk)
                finishing[i] = state.prefilled + len(chunk) == len(state.request.prompt_ids)
        mode = rows_mode([self._slots[s].request.settings.sampling for i, s in enumerate(rows) if finishing[i]])
        first = self._prefill_call(rows, tokens, counts, finishing, mode)
        done = []
        for i, slot in enumerate(rows):
            if slot is not None:
                state = self._slots[slot]
                state.prefilled += counts[i]
                if finishing[i]:
                    state.queued = 1
                    done.append((i, slot, state))
        return to_host_soon(first), done

    def _decode_call(self, steps_done: np.ndarray):
        """decode_slots and pick_next with each slot's sampling step (-1: idle) -> the next tokens [S]
        on the devices."""
        if self._slot_settings is None:  # changes only when a slot changes hands
            requests = [s and s.request for s in self._slots]
            mode = rows_mode([r.settings.sampling for r in requests if r is not None])
            self._slot_settings = (*self._sampling_arrays(requests), mode)
        *settings, mode = self._slot_settings
        steps_done = self._put(steps_done)
        logits, self._cache = steps.decode_slots(*self._model, self.params, self._cache, self._last, steps_done)
        self._last = steps.pick_next(self.mesh, mode, logits, self._last, steps_done, *settings)
        return self._last

    def _decode(self, slots: list[int]):
        """Queue one decode step of these slots -> (their tokens on the devices, the rows)."""
        steps_done = np.full(self.slots, -1, np.int32)
        rows = []
        for slot in slots:
            state = self._slots[slot]
            steps_done[slot] = state.queued
            state.queued += 1
            rows.append((slot, slot, state))
        return to_host_soon(self._decode_call(steps_done)), rows

    def _read(self, tokens, rows) -> None:
        """Hand a queued step's tokens to their requests (rows of requests that ended since are dropped)."""
        tokens = np.asarray(tokens)
        for i, slot, state in rows:
            if self._slots[slot] is state:
                self._emit(slot, int(tokens[i]))

    def _emit(self, slot: int, token: int) -> None:
        """Hand a slot's new token to its request; free the slot if that ends it."""
        state = self._slots[slot]
        request, settings = state.request, state.request.settings
        request._add(token, time.perf_counter())
        self.metrics.token(request)
        if token in settings.stop_ids:
            return self._free(slot, "stop")
        if settings.stop_strings:  # the reply's new text, in time linear in it (stops.py)
            if state.stops is None:
                state.decoder, state.stops = StreamDecoder(self.tokenizer), StopMatcher(settings.stop_strings)
            if state.stops.feed(state.decoder.add(token)) is not None:
                return self._free(slot, "stop")
        if len(request.output_ids) >= settings.max_new_tokens:
            self._free(slot, "length")

    def _has_work(self) -> bool:
        return bool(self._waiting or self._admitted or self._in_flight)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait()
                if self._stopping and not self._has_work():
                    return
            try:
                self.step()
            except LockstepError as e:  # the other processes are gone: nothing more can run
                with self._lock:
                    self._lost = str(e)
                    ended = list(self._waiting) + [self._slots[s].request for s in self._admitted]
                    self._waiting.clear()
                    self._slots, self._admitted, self._in_flight = [None] * self.slots, [], []
                for request in ended:
                    request._finish("error", time.perf_counter(), error=self._lost)
                    self.metrics.finish(request)
                return
            except Exception as e:  # a failed step ends the requests it held, never the engine
                self._fail_running(f"{type(e).__name__}: {e}")

    def _fail_running(self, message: str) -> None:
        self._slot_settings = None
        # The step may have consumed the donated cache: start from a fresh one.
        self._cache = init_cache(self.config, self.slots, self.max_len, self.params["embedding"].dtype, mesh=self.mesh)
        self._last, self._in_flight = self._put(np.zeros(self.slots, np.int32)), []
        for slot in list(self._admitted):
            request = self._slots[slot].request
            self._slots[slot] = None
            self._admitted.remove(slot)
            request._finish("error", time.perf_counter(), error=message)
            self.metrics.finish(request)

"""Continuous batching over a paged KV cache: requests run as soon as a row and pages for them are
free, and a prompt whose beginning is already cached computes only the rest.

    engine = Engine(config, params, EngineConfig(slots=64, max_len=131072))
    engine.start()                                    # a thread runs the steps
    request = engine.submit([1, 2, 3], Settings(max_new_tokens=32))
    for token in request.tokens():
        print(token)
    engine.stop()

Memory is a pool of pages of `page_size` positions (paged_cache.py), taken as sequences grow;
full pages are named by their prefix and stay cached after their sequence ends, so a later prompt
with the same beginning (a conversation's next turn, an agent's system prompt and tools) shares
them (scheduler.py, pages.py).

Each step of the engine (`step`; docs/serving.md, "How it works"): admits waiting requests while a
row and pages are free (preempted ones first); prefills one chunk of the earliest prompts still
prefilling (a chunk ending a prompt samples its first token); queues the decode of every sequence
past its prompt from the rows' latest tokens on the devices, so the host never waits for a step
before queueing the next; reads the step before's tokens meanwhile, ends requests at a stop token,
stop string or budget, makes constrained rows' masks, and queues the picks, each row's token by its
own settings. When the pool runs out of pages, the latest admitted sequence is preempted and
prefilled again later, its tokens unchanged. A request's own failure ends it alone (`_alone`). Shapes
never change with the traffic, so nothing compiles after `warm_up`. With several processes, process
0 takes the requests and the others run the same steps with `follow()` (lockstep.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from .. import fp8
from ..config import ModelConfig
from ..decoding.steps import Model
from ..drafts.base import Draft
from ..kernels import Kernels
from ..model.paged_cache import PoolSize, pool_pages, table_width
from ..sampling import MODES, rows_mode
from ..sharding import mesh_of, to_host_soon
from ..weight import Params
from . import steps, stops
from .config import EngineConfig
from .constrain import Grammars
from .device import Device
from .lockstep import Lockstep, LockstepError, Message
from .metrics import Metrics
from .request import QueueFull, Request, Settings, TokenLogprob, check_prompt
from .scheduler import Scheduler, Seq, decode_sizes_for, prefill_rows_for, sliding_most, slots_for
from .speculation import Speculation, stateful

log = logging.getLogger("gptoss_jax.serving")


class Engine:
    """Serves many concurrent requests on one set of parameters (see the module's docstring), with
    the settings `options` (config.py: rows, context, prefill, pages, speculation); draft: a draft
    source (drafts/base.py) for speculative decoding (speculation.py)."""

    def __init__(self, config: ModelConfig, params: Params, options: EngineConfig = EngineConfig(), *,
                 kernels: Kernels = Kernels(), tokenizer=None, draft: Draft | None = None):
        max_len = options.max_len or config.max_context_length
        if max_len > config.max_context_length:
            raise ValueError(f"max context {max_len} exceeds the model's {config.max_context_length}")
        head = draft if stateful(draft) else None  # follows every step, its cache a page beside the pool's
        kv_dtype = fp8.cache_dtype(options.kv_dtype, params["embedding"].dtype)
        page_size, prefill_chunk = options.page_size, min(options.prefill_chunk, max_len)
        extra = head.page_bytes(page_size) if head else 0
        known = options.pages or pool_pages(config, page_size, kv_dtype, options.kv_memory, extra=extra)
        slots = options.slots or slots_for(None if known is None else known * page_size)
        self.slots_by_pool = options.slots is None and known is not None  # (what gptoss-serve's start-up says)
        rows = options.prefill_rows or prefill_rows_for(slots)
        options = options.replace(max_len=max_len, prefill_chunk=prefill_chunk, slots=slots, prefill_rows=rows)
        self.config, self.params, self.kernels, self.tokenizer = config, params, kernels, tokenizer
        self.options = options
        self.slots, self.max_len, self.prefill_chunk, self.page_size = slots, max_len, prefill_chunk, page_size
        # Prompts prefilled together: one alone, or up to prefill_rows (two compiled shapes).
        self.prefill_shapes = sorted({1, min(options.prefill_rows, slots)})
        self.decode_sizes = list(options.decode_sizes or decode_sizes_for(slots))
        self.speculation = None if draft is None else Speculation(draft, options, self.decode_sizes)
        self.mesh = mesh_of(params)
        self.width, self.metrics = table_width(max_len, page_size), Metrics()
        # Where JAX does not say how much memory is free (a CPU): every slot with 8,192 positions, and at
        # least one sequence of the whole context.
        most = sliding_most(config, page_size, prefill_chunk)
        count = known or max(slots * (table_width(min(max_len, 8192), page_size) + most), self.width + most)
        self.scheduler = Scheduler(config, slots=slots, page_size=page_size, pages=count, prefill_chunk=prefill_chunk,
                                   metrics=self.metrics, reuse=options.prefix_reuse)
        self.grammars = None if tokenizer is None else Grammars(tokenizer, config.vocab_size)
        self.device = Device(Model(config, kernels, self.mesh), params, slots=slots, width=self.width,
                             pool=PoolSize(count, page_size, kv_dtype), grammars=self.grammars, tokenizer=tokenizer)
        if head is not None:
            self.device.draft_with(head)
        self._in_flight: list = []  # the step before's (tokens, [(row in them, Seq)], log-probabilities or None)
        self._waiting: collections.deque[Request] = collections.deque()
        self._ids, self._lock = itertools.count(), threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.compiled: list[str] = []
        self._lockstep = Lockstep.of_this_process()  # None: one process
        if self._lockstep is not None and draft is not None:
            raise ValueError("speculative decoding runs on one process (a mesh of its devices), not several")
        self._lost: str | None = None  # why the other processes were lost (then nothing more is taken)

    # The Python API ------------------------------------------------------------------------------------

    @property
    def pool_tokens(self) -> int:
        """Positions the pool holds (every page in a full layer's group)."""
        return self.scheduler.pages.count * self.page_size

    def submit(self, prompt_ids: Sequence[int], settings: Settings = Settings(),
               listener: Callable[[int | None], None] | None = None, after: Request | None = None) -> Request:
        """Queue a request; QueueFull at once when `max_waiting` requests already wait beyond those the
        free rows take at the next step, ValueError for a prompt the engine cannot take (empty, ids
        outside the vocabulary, too long for the context or for the pool alone). `listener`: called
        on the engine's thread with each token, then None when the request finishes (request.py).
        `after`: a request with the same prompt (choices of one API request): this one is admitted
        once that one's prompt is computed, and finds it in the cache."""
        prompt = list(prompt_ids)
        check_prompt(prompt, settings, self.config.vocab_size, self.max_len, self.device.served)
        need, count = self.scheduler.pages_alone(len(prompt) + settings.max_new_tokens), self.scheduler.pages.count
        if need > count:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus {settings.max_new_tokens} new tokens needs "
                             f"{need} pages of the KV cache, more than its {count} ({self.pool_tokens} positions)")
        if (settings.stop_strings or settings.grammar is not None) and self.tokenizer is None:
            raise ValueError("stop strings and grammars need the engine's tokenizer (Engine(..., tokenizer=...))")
        matcher = None if settings.grammar is None else self.grammars.matcher(settings.grammar)
        if self._following:
            raise RuntimeError(f"process {self._lockstep.process_index} follows process 0: submit requests there")
        if self._lost is not None:
            raise RuntimeError(f"the engine stopped: {self._lost}")
        with self._lock:
            # A request that finds a row free is taken whatever max_waiting says: it waits only until
            # the next step (or until the pool has room).
            free = self.scheduler.rows.count(None)
            if len(self._waiting) >= self.options.max_waiting + free:
                self.metrics.rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this engine queues "
                                f"({self.options.max_waiting} beyond the {free} slots free)")
            request = Request(next(self._ids), prompt, settings, listener)
            request._matcher, request._after = matcher, after
            self._waiting.append(request)
            self._wake.notify()
        return request

    def put_adapter(self, index: int, weights: Params | None) -> None:
        """Entry `index` of the served adapters' table holds `weights` (scales folded in; None: none) from the next
        step on, and prefixes cached under it before are never found. No request may be running under it."""
        with self._lock:
            self.device.put_adapter(index, weights)
            self.params = self.device.params
            self.scheduler.reseed(index)

    def stats(self) -> dict:
        with self._lock:
            state = self.scheduler.state(waiting=len(self._waiting))
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
        """Run the steps on a thread of their own until `stop` (process 0 of several; the others: `follow`)."""
        if self._following:
            raise RuntimeError("a process other than 0 runs follow(), not start()")
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="gptoss-engine", daemon=True)
            self._thread.start()

    def stop(self, cancel: bool = True) -> None:
        """Stop taking steps: cancel=True cancels every request not yet finished (their pages are freed
        at once); cancel=False lets them finish first."""
        with self._lock:
            if cancel:
                for r in [*self._waiting, *self.scheduler.preempted, *(s.request for s in self.scheduler.admitted)]:
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
            except Exception as e:  # noqa: BLE001 -- as process 0 does: the step failed there as well
                self._fail_running(f"{type(e).__name__}: {e}")

    def warm_up(self) -> list[str]:
        """Compile the steps (nothing is generated, no page or row changes) and say what was compiled."""
        C, device = self.prefill_chunk, self.device
        outputs = []
        idle = device.picks.rows([None] * self.slots, self.scheduler.changes)[0]
        picks = list(itertools.product(MODES, ((False, False), (True, True))))  # alone; with adjust, log-probabilities
        with device.picks.compiling():  # the model steps run once a shape; the picks compile on their logits
            for P in self.prefill_shapes:
                prefilled = device.prefill(np.array([[self.slots] * P] + [[0] * P] * 5, np.int32),  # padding rows
                                           np.zeros((P, C), np.int32))
                outputs += [device.pick_first(prefilled, idle, mode, wants, [None] * P) for mode, wants in picks]
            for B in self.decode_sizes:
                decoded = device.decode(np.array([[self.slots] * B, [0] * B, [-1] * B, [0] * B], np.int32))
                outputs += [device.pick(decoded, (idle, mode, wants), [None] * B) for mode, wants in picks]
        checked = [] if self.speculation is None else [self.speculation.warm_up(self)]
        device.picks.warm_up()
        if self.grammars is not None:
            self.grammars.load()
        device.write_tables([(0, self.slots, 0, 0)])  # padding: dropped
        device.take_adapter(0, None)  # (no request holds a row)
        device.ready(outputs)
        self.compiled = [f"prefill [{P}, {C}]" for P in self.prefill_shapes] + [
            f"decode step [{', '.join(map(str, self.decode_sizes))}]",
            f"token picks ({', '.join(MODES)}), adjusted logits, log-probabilities "
            f"[{', '.join(map(str, self.prefill_shapes + self.decode_sizes))}]", *checked,
            f"KV cache {self.scheduler.pages.count} pages of {self.page_size} ({self.pool_tokens} positions), "
            f"tables [2, {self.slots}, {self.width}]"]
        return self.compiled

    def run_until_idle(self) -> None:
        """Run steps on this thread until nothing is waiting or running (tests, batch jobs)."""
        while self.step():
            pass

    # The steps ---------------------------------------------------------------------------------------------

    def row_settings(self):
        """Every row's sampling settings on the devices, the running rows' sampling mode and what their
        picks do beyond sampling (steps.wants)."""
        return self.device.picks.rows([s and s.request for s in self.scheduler.rows], self.scheduler.changes)

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
                cancelled, dropped = self._free_cancelled()
                self.scheduler.admit_preempted()
                admitted = self._admit()
                if self._lockstep is not None:
                    self._lockstep.send(Message(cancelled, [(s.row, s.request) for s in admitted], dropped=dropped))
        for seq in self.scheduler.taken():  # each request's settings become its row's: a failure is its own
            self._alone(seq, self.device.picks.taken, seq.request, seq.row)
            self.device.take_adapter(seq.row, seq.request.settings.adapter)
        prefilling = [s for s in self.scheduler.admitted if s.prefilling][:self.prefill_shapes[-1]]
        decoding = [s for s in self.scheduler.admitted
                    if not s.prefilling and s.queued < s.request.settings.max_new_tokens]
        alone = not (prefilling or self._waiting or self.scheduler.preempted)  # a call may run several steps
        speculate = self.speculation is not None and self.speculation.wanted(decoding, alone)
        prefilling, decoding = self.scheduler.make_room(prefilling, decoding,
                                                        self.speculation.ahead if speculate else None)
        self.device.write_tables(self.scheduler.take_table_writes())
        queued = []
        if prefilling:
            queued.append(self._prefill(prefilling))
        call = self.speculation.queue(self, decoding) if speculate else None  # (drafted on the devices)
        speculate = speculate and (call is not None or not self.speculation.on_devices)  # none due: decode
        if decoding and not speculate:
            decoded = self._decode(decoding)
        for seq in prefilling + ([] if speculate else decoding):
            self.scheduler.after_step(seq)
        before, self._in_flight = self._in_flight, queued
        for tokens, rows, logprobs in before:  # read while the device runs this step's model
            self._read(tokens, rows, logprobs)
        if speculate:  # drafted from the tokens just read, or the call's tokens read
            self.speculation.step(self, decoding, call)
        elif decoding:  # picked once the step before's tokens are read: the grammars' masks follow them
            queued.append(self._pick(*decoded))
        self._end_broken()
        return bool(queued or before or speculate or self._waiting or self.scheduler.preempted)

    # Admission, pages and preemption ----------------------------------------------------------------

    def _free_cancelled(self) -> tuple[list[int], list[int]]:
        """Drop cancelled requests -> (rows freed, in order; ids of preempted requests dropped)."""
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._end(r, "cancelled")
        dropped = [r for r in self.scheduler.preempted if r.cancelled]
        for r in dropped:
            self._drop_preempted(r)
        freed = [s for s in self.scheduler.admitted if s.request.cancelled]
        for seq in freed:
            self._free(seq, "cancelled")
        return [s.row for s in freed], [r.id for r in dropped]

    def _drop_preempted(self, request: Request) -> None:
        self.scheduler.preempted.remove(request)
        self._end(request, "cancelled")

    def _end(self, request: Request, reason: str, error: str | None = None, invalid: bool = False) -> None:
        request._finish(reason, time.perf_counter(), error=error, invalid=invalid)
        self.metrics.finish(request)

    def _admit(self) -> list[Seq]:
        """Waiting requests into free rows while the pool has room for them -> the sequences admitted
        (those whose `after` has not its first token yet wait on, in their place)."""
        admitted, later = [], []
        while self._waiting and not self.scheduler.preempted and (row := self.scheduler.free_row()) is not None:
            after = self._waiting[0]._after
            if after is not None and after.first_token_at is None and not after.finished:
                later.append(self._waiting.popleft())
            elif (prefix := self.scheduler.fits(self._waiting[0])) is not None:
                admitted.append(self.scheduler.take(row, self._waiting.popleft(), prefix))
            else:
                break
        self._waiting.extendleft(reversed(later))
        return admitted

    def _free(self, seq: Seq, reason: str, error: str | None = None, invalid: bool = False) -> None:
        self.scheduler.release(seq)
        self._end(seq.request, reason, error, invalid)

    # Prefill and decode ---------------------------------------------------------------------------------

    def _prefill(self, prefilling: list[Seq]):
        """Queue one chunk of each of these sequences -> (first tokens on the devices, the rows whose
        prompts it ends)."""
        P = self.prefill_shapes[-1] if len(prefilling) > 1 else 1
        seqs: list[Seq | None] = prefilling + [None] * (P - len(prefilling))
        C = self.prefill_chunk
        tokens, counts, starts = np.zeros((P, C), np.int32), [0] * P, [0] * P
        finishing, sample_steps = [False] * P, [0] * P
        for i, seq in enumerate(prefilling):
            chunk = seq.tokens[seq.length:seq.length + C]
            tokens[i, :len(chunk)], counts[i], starts[i] = chunk, len(chunk), seq.length
            finishing[i] = seq.length + len(chunk) == len(seq.tokens)
            sample_steps[i] = seq.queued
        ending = [s.request if i < len(prefilling) and finishing[i] else None for i, s in enumerate(seqs)]
        settings = [r.settings for r in ending if r is not None]
        fresh = [s is not None and s.length == s.computed_from for s in seqs]  # its part of the cache starts here
        plan = np.array([[self.slots if s is None else s.row for s in seqs], counts, starts, finishing,
                         sample_steps, fresh], np.int32)
        first, logprobs = self.device.pick_first(self.device.prefill(plan, tokens), self.row_settings()[0],
                                                 rows_mode([s.sampling for s in settings]), steps.wants(settings),
                                                 ending)
        done = []
        for i, seq in enumerate(prefilling):
            seq.length += counts[i]
            if finishing[i]:
                seq.queued += 1
                done.append((i, seq))
        return to_host_soon(first), done, to_host_soon(logprobs)

    def _decode(self, decoding: list[Seq]):
        """Queue the model step of one decode step of these sequences -> what `_pick` needs to pick
        their tokens."""
        B = next(b for b in self.decode_sizes if b >= len(decoding))
        seqs = decoding + [None] * (B - len(decoding))
        lengths = [s.length for s in decoding] + [0] * (B - len(decoding))
        settings = self.row_settings()
        decoded = self.device.decode(np.array([[self.slots if s is None else s.row for s in seqs], lengths,
                                               [-1 if s is None else s.queued for s in seqs],
                                               [0 if s is None else 1 for s in seqs]], np.int32))
        for seq in decoding:
            seq.length += 1
            seq.queued += 1
        return decoded, settings, seqs

    def _pick(self, decoded, settings, seqs: list[Seq | None]):
        """Queue the picks of a decode step (decoded: its logits and plan; settings: the rows', their
        mode and wants) -> (their tokens [R], the rows, log-probabilities by row or None)."""
        last, logprobs = self.device.pick(decoded, settings, [s and s.request for s in seqs])
        return to_host_soon(last), [(s.row, s) for s in seqs if s is not None], to_host_soon(logprobs)

    def _read(self, tokens, rows, logprobs) -> None:
        """Hand a queued step's tokens (and log-probabilities, where asked for) to their requests (those
        of sequences ended or preempted since are dropped)."""
        tokens = np.asarray(tokens)
        picked = None if logprobs is None else [np.asarray(x) for x in logprobs]
        for i, seq in rows:
            if self.scheduler.rows[seq.row] is seq:
                n = seq.request.settings.logprobs
                self.emit(seq, int(tokens[i]), None if n is None else TokenLogprob.of_row(picked, i, n))

    def emit(self, seq: Seq, token: int, logprob: TokenLogprob | None = None) -> None:
        """Hand a sequence's new token to its request; free the sequence if that ends it (or fails it)."""
        self._alone(seq, self._emit_one, seq, token, logprob)

    def _emit_one(self, seq: Seq, token: int, logprob: TokenLogprob | None) -> None:
        request, settings = seq.request, seq.request.settings
        request._add(token, time.perf_counter(), logprob)
        self.metrics.token(request)
        if request._matcher is not None and not Grammars.consume(request._matcher, token):
            return self._free(seq, "error", f"the reply cannot follow its grammar: {Grammars.error(request._matcher)}",
                              invalid=True)
        if stops.ends(request, token, self.tokenizer):
            return self._free(seq, "stop")
        if len(request.output_ids) >= settings.max_new_tokens:
            self._free(seq, "length")

    def _alone(self, seq: Seq, fn, *args) -> None:
        """fn(*args), host work of one sequence's request (its settings, its grammar, its stop strings;
        every process of several does it alike): what it raises ends that request alone, with the error."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 -- this request's failure, told to it and logged
            log.error("request %d failed alone: %s: %s", seq.request.id, type(e).__name__, e)
            if self.scheduler.rows[seq.row] is seq:
                self._free(seq, "error", f"{type(e).__name__}: {e}")

    def _end_broken(self) -> None:
        """End the requests whose grammars failed at this step's masks: the client's error, each alone."""
        broken, self.device.picks.broken = self.device.picks.broken, []
        for seq, error in [(s, e) for r, e in broken for s in self.scheduler.admitted if s.request is r]:
            self._free(seq, "error", f"the reply cannot follow its grammar: {error}", invalid=True)

    def _has_work(self) -> bool:
        return bool(self._waiting or self.scheduler.preempted or self.scheduler.admitted or self._in_flight)

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
                return self._lose(e)
            except Exception as e:  # a failed step ends the requests it held, never the engine
                self._fail_running(f"{type(e).__name__}: {e}")

    def _reset(self) -> None:
        """A fresh pool, tables and rows (a step may have consumed the donated pool): nothing is held or
        cached any more."""
        self.scheduler.reset()
        self._in_flight = []
        self.device.reset()

    def _fail_running(self, message: str) -> None:
        """A failed step, an error of the step itself (the devices'; the host's work of one request ends
        that request alone: `_alone`): the running requests end with the error; preempted ones wait on
        (they start again from their prompts and the tokens they have)."""
        ended = [s.request for s in self.scheduler.admitted]
        log.error("an engine step failed (%s): the %d requests running end with it (ids %s)", message, len(ended),
                  ", ".join(str(r.id) for r in ended) or "none")
        self._reset()
        for request in ended:
            self._end(request, "error", message)

    # Several processes (lockstep.py) ------------------------------------------------------------------

    def _apply(self, message: Message) -> None:
        """A follower: process 0's decisions for this step, in the order process 0 made them."""
        scheduler = self.scheduler
        for row in message.cancel:
            self._free(scheduler.rows[row], "cancelled")
        for request_id in message.dropped:
            self._drop_preempted(next(r for r in scheduler.preempted if r.id == request_id))
        scheduler.admit_preempted()
        for row, request in message.admit:
            if scheduler.rows[row] is not None:
                raise LockstepError(f"process {self._lockstep.process_index} differs from process 0: row {row} is "
                                    f"still taken here")
            if request.settings.grammar is not None:
                request._matcher = self.grammars.matcher(request.settings.grammar)
            scheduler.take(row, request)

    def _lose(self, error: LockstepError) -> None:
        """The other processes are gone: every request ends with the error, and the engine takes no more."""
        with self._lock:
            self._lost = str(error)
            ended = [*self._waiting, *self.scheduler.preempted, *(s.request for s in self.scheduler.admitted)]
            self._waiting.clear()
            self.scheduler.preempted.clear()
            self._reset()
        for request in ended:
            self._end(request, "error", self._lost)

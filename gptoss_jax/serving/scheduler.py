"""Who runs and what each holds: the serving engine's rows, its sequences' pages, their prefixes found
in the cache, and preemption when the pool runs short. Host bookkeeping only: the engine (engine.py)
runs the steps, and sends the table entries set here (`table_writes`) before each.

A sequence holds pages of both groups (paged_cache.py): full layers every page from its first
position on, sliding layers the pages of its window and of the step's new positions, released once
no later query sees them. Pages are named once whole and known (pages.py), so that they outlive the
sequence in the cache; a prefix is found as every full page from the first that carries the
prompt's name, and the sliding pages of its last window.

Every decision here follows from what every process of several sees alike (admissions, cancellations,
the tokens read), so that they all take the same pages (lockstep.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from ..config import ModelConfig
from ..model.paged_cache import FULL, SLIDING, window_pages
from .metrics import Metrics
from .pages import Pages, adapter_seed, extend_hashes
from .request import Request


def sliding_most(config: ModelConfig, page_size: int, prefill_chunk: int) -> int:
    """Sliding pages one sequence holds at most: its window's, and a chunk's new ones."""
    return window_pages(config, page_size) + -(-prefill_chunk // page_size) + 1


@dataclasses.dataclass
class Seq:
    """A request holding a row: where its sequence stands, and its pages."""

    request: Request
    row: int
    tokens: list[int]  # what the cache is to hold before the next token: the prompt, after a preemption
    # also the reply read so far
    full: list[int]  # group FULL: the page of each logical page, from the first
    sliding: dict[int, int]  # group SLIDING: logical page -> page, those still in the window
    length: int = 0  # positions in the cache once the queued steps have run
    queued: int = 0  # tokens sampled so far, read or not (the next one's sampling step)
    named: int = 0  # its first pages that carry their names, those found in the cache included
    released: int = 0  # its sliding pages before this one are released (out of the window)
    draft_due: int = 0  # speculation.py: the engine step from which it drafts again
    draft_misses: int = 0  # speculation.py: its drafting steps since one accepted a drafted token
    drafted_from: int = 0  # speculation.py: its tokens (prompt and reply) in the history on the devices
    computed_from: int = 0  # the position from which its admission computes (after a prefix found cached)

    @property
    def prefilling(self) -> bool:
        return self.length < len(self.tokens)


class Scheduler:
    """`slots` rows over a pool of `pages` pages of `page_size` positions (see the module)."""

    def __init__(self, config: ModelConfig, *, slots: int, page_size: int, pages: int, prefill_chunk: int,
                 metrics: Metrics, reuse: bool = True):
        self.config, self.slots, self.page_size, self.prefill_chunk = config, slots, page_size, prefill_chunk
        self.reuse = reuse  # False: no prefix is looked up or named (every prompt computed whole)
        self.metrics = metrics
        self.sliding_most = sliding_most(config, page_size, prefill_chunk)
        self.pages = Pages(pages)
        self.rows: list[Seq | None] = [None] * slots
        self.admitted: list[Seq] = []  # running sequences in the order they were admitted
        self.preempted: collections.deque[Request] = collections.deque()  # back to waiting, first in line
        self.table_writes: list[tuple[int, int, int, int]] = []  # (group, row, column, page) not yet sent
        self.changes = 0  # counts rows changing hands (the engine keeps the rows' settings until then)
        self._taken: list[Seq] = []  # sequences that took a row since `taken` was last asked
        self.generations: dict[int, int] = {}  # adapter -> how many times its table entry was put since the first

    def seed(self, request: Request) -> bytes:
        """The start of the request's page names: its served adapter's, as its table entry held it when
        first asked (at admission), whatever is put there later."""
        if request._page_seed is None:
            adapter = request.settings.adapter
            request._page_seed = adapter_seed(adapter, self.generations.get(adapter, 0))
        return request._page_seed

    def reseed(self, adapter: int) -> None:
        """A served adapter's table entry holds another one now: the prefixes cached under it are never found."""
        self.generations[adapter] = self.generations.get(adapter, 0) + 1

    def take_table_writes(self) -> list[tuple[int, int, int, int]]:
        """The table entries set since the last call (the engine sends them before each step)."""
        writes, self.table_writes = self.table_writes, []
        return writes

    def reset(self) -> None:
        """Nothing held or cached any more (the pool on the devices is new); preempted requests wait on."""
        self.pages = Pages(self.pages.count)
        self.rows, self.admitted, self.table_writes, self._taken = [None] * self.slots, [], [], []
        self.changes += 1

    def state(self, waiting: int) -> dict:
        """Rows and pages in use, for the engine's stats (waiting: requests not yet admitted)."""
        used, pages = len(self.admitted), self.pages
        return {"running": used, "prefilling": sum(s.prefilling for s in self.admitted),
                "waiting": waiting + len(self.preempted), "slots_in_use": used, "slots": self.slots,
                "pages": pages.count, "pages_in_use": pages.held, "pages_cached": pages.cached,
                "page_size": self.page_size, "pages_evicted": pages.evicted}

    def pages_alone(self, tokens: int) -> int:
        """Pages one sequence of this many positions holds at most."""
        full = -(-tokens // self.page_size)
        return full + min(self.sliding_most, full + 1)

    # Admission ----------------------------------------------------------------------------------------

    def free_row(self) -> int | None:
        return self.rows.index(None) if None in self.rows else None

    def _tokens_of(self, request: Request) -> list[int]:
        return request.prompt_ids + request.output_ids

    def cached_prefix(self, request: Request) -> tuple[list[int], dict[int, int]]:
        """The longest cached prefix of whole pages before the request's last token (which is always
        computed, for its logits): (full-layer pages from the first, sliding-layer pages of its last
        window by logical page)."""
        if not self.reuse:
            return [], {}
        tokens, P = self._tokens_of(request), self.page_size
        # (a preempted request may have named every page of its tokens: the last one's is left out)
        names = extend_hashes(request._page_names, tokens[:(len(tokens) - 1) // P * P], P,
                              self.seed(request))[:(len(tokens) - 1) // P]
        full = []
        for name in names:
            page = self.pages.find(FULL, name)
            if page is None:
                break
            full.append(page)
        for n in range(len(full), 0, -1):  # the sliding layers need the window before position n P
            first = max(n * P - self.config.sliding_window + 1, 0) // P
            sliding = {i: self.pages.find(SLIDING, names[i]) for i in range(first, n)}
            if None not in sliding.values():
                return full[:n], sliding
        return [], {}

    def fits(self, request: Request):
        """The request's cached prefix (`cached_prefix`) when the pool has pages for its prompt and first
        token beyond it (pages cached but held by none count as free, except those the prefix itself
        would hold), else None."""
        full, sliding = prefix = self.cached_prefix(request)
        shared = full + list(sliding.values())
        idle_shared = sum(self.pages.refs(p) == 0 for p in shared)
        need = self.pages_alone(len(request.prompt_ids) + len(request.output_ids) + 1) - len(shared)
        return prefix if need <= self.pages.available - idle_shared else None

    def take(self, row: int, request: Request, prefix=None) -> Seq:
        """The request into this row, holding its cached prefix's pages (`prefix`: as `fits` found it)."""
        full, sliding = prefix or self.cached_prefix(request)
        for page in itertools.chain(full, sliding.values()):
            self.pages.share(page)
        seq = Seq(request, row, self._tokens_of(request), full, sliding, length=len(full) * self.page_size,
                  queued=len(request.output_ids), named=len(full), computed_from=len(full) * self.page_size)
        self.table_writes += [(FULL, row, i, page) for i, page in enumerate(full)]
        self.table_writes += [(SLIDING, row, i, page) for i, page in sliding.items()]
        self.rows[row] = seq
        self.admitted.append(seq)
        self._taken.append(seq)
        self.changes += 1
        if request.cached_tokens is None:  # the first admission: a preempted request's return is no prompt
            request.cached_tokens = seq.length
            self.metrics.prompt(len(request.prompt_ids), seq.length)
        return seq

    def taken(self) -> list[Seq]:
        """The sequences that took a row since the last call and still hold it."""
        taken, self._taken = self._taken, []
        return [s for s in taken if self.rows[s.row] is s]

    def admit_preempted(self) -> None:
        """Preempted requests back into free rows, first in line, while they fit."""
        while self.preempted and (row := self.free_row()) is not None and (
                prefix := self.fits(self.preempted[0])) is not None:
            self.take(row, self.preempted.popleft(), prefix)

    # Growth and preemption ----------------------------------------------------------------------------

    def _grow(self, seq: Seq, end: int) -> bool:
        """Pages for the sequence's positions up to `end` in both groups -> False if the pool ran out
        (the pages taken so far stay the sequence's)."""
        last = (end - 1) // self.page_size
        while len(seq.full) <= last:
            page = self.pages.take()
            if page is None:
                return False
            self.table_writes.append((FULL, seq.row, len(seq.full), page))
            seq.full.append(page)
        for i in range(seq.length // self.page_size, last + 1):
            if i not in seq.sliding:
                page = self.pages.take()
                if page is None:
                    return False
                self.table_writes.append((SLIDING, seq.row, i, page))
                seq.sliding[i] = page
        return True

    def make_room(self, prefilling: list[Seq], decoding: list[Seq], ahead=None) -> tuple[list[Seq], list[Seq]]:
        """Pages for this step's new positions (a chunk of each prefilling sequence, one position of each
        decoding one, or `ahead(seq)` of them: a speculated step's), earliest admitted first; where the
        pool runs out, the most recently admitted sequences are preempted (even the one growing) ->
        (prefilling, decoding) still running."""
        grow = {id(s): min(self.prefill_chunk, len(s.tokens) - s.length) for s in prefilling}
        if ahead is not None:
            grow.update((id(s), ahead(s)) for s in decoding)
        else:
            grow.update((id(s), 1) for s in decoding if s.length % self.page_size == 0)  # else its page is held
        for seq in list(self.admitted):
            while id(seq) in grow and self.rows[seq.row] is seq and not self._grow(seq, seq.length + grow[id(seq)]):
                self.preempt(self.admitted[-1])
        return [s for s in prefilling if self.rows[s.row] is s], [s for s in decoding if self.rows[s.row] is s]

    def preempt(self, seq: Seq) -> None:
        """Back to waiting, first in line; its pages released (named ones stay cached for its return)."""
        self.release(seq)
        self.preempted.appendleft(seq.request)
        self.metrics.preemptions += 1

    def release(self, seq: Seq) -> None:
        """The sequence's row and pages (named first where whole and known, then latest first, so that a
        prefix outlives its tail in the cache)."""
        self._name_pages(seq)
        for page in reversed(list(seq.sliding.values())):
            self.pages.release(page)
        for page in reversed(seq.full):
            self.pages.release(page)
        seq.full, seq.sliding = [], {}
        self.rows[seq.row] = None
        self.admitted.remove(seq)
        self.changes += 1

    def _name_pages(self, seq: Seq) -> None:
        """Name the sequence's pages that are whole (every position queued into the cache) and whose
        tokens are known (a reply's are once read)."""
        if not self.reuse:
            return
        known = self._tokens_of(seq.request)
        whole = min(len(known), seq.length) // self.page_size
        names = extend_hashes(seq.request._page_names, known[:whole * self.page_size], self.page_size,
                              self.seed(seq.request))
        for i in range(seq.named, whole):
            self.pages.name(seq.full[i], FULL, names[i])
            if i in seq.sliding:
                self.pages.name(seq.sliding[i], SLIDING, names[i])
            seq.named = i + 1

    def after_step(self, seq: Seq) -> None:
        """After a step of the sequence is queued: name what it filled; release the sliding pages no
        later query sees (the next one, at position `length`, sees keys past length - window)."""
        if seq.length // self.page_size > seq.named:
            self._name_pages(seq)
        gone = (seq.length - self.config.sliding_window + 1) // self.page_size  # pages wholly before the window
        if gone > seq.released:
            for i in [i for i in seq.sliding if i < gone]:
                self.pages.release(seq.sliding.pop(i))
            seq.released = gone


# Slots by default, where the pool's size is known (a GPU's memory): one per SLOT_POSITIONS positions the
# pool holds (a 1k prompt and its 1k reply), the power of two at or below that, within SLOTS. On one
# NVIDIA H200, gpt-oss-20b's 1k/1k traffic still gains output from 512 to 1,024 requests at once; vLLM
# admits up to 1,024 sequences there by default.
SLOT_POSITIONS = 2048
SLOTS = (16, 1024)


def slots_for(pool_positions: int | None) -> int:
    """The engine's slots by default for a pool of this many positions (None: unknown, a CPU: 16)."""
    if pool_positions is None:
        return SLOTS[0]
    fits = max(1, pool_positions // SLOT_POSITIONS)
    return min(max(1 << (fits.bit_length() - 1), SLOTS[0]), SLOTS[1])


# Prompts prefilled together by default: PREFILL_ROWS[1] from MANY_SLOTS slots, else PREFILL_ROWS[0]. On one
# NVIDIA H200 (gpt-oss-20b, MXFP4 experts, 1k/1k with 1,024 requests at once, pages of 64) 8 rows of 512
# gave 15,843 output tokens/s against 13,802 with 4: 1,024 prompts arriving together are taken in half
# the steps; with few slots, a larger prefill only holds the running requests' next tokens longer.
PREFILL_ROWS = (4, 8)
MANY_SLOTS = 256


def prefill_rows_for(slots: int) -> int:
    """The prompts the engine prefills together by default, for this many slots."""
    return PREFILL_ROWS[1] if slots >= MANY_SLOTS else PREFILL_ROWS[0]


def decode_sizes_for(slots: int) -> list[int]:
    """The decode step's sizes by default: every slot, and each quarter down to 8 or so."""
    sizes = [slots]
    while sizes[-1] // 4 >= 8:
        sizes.append(sizes[-1] // 4)
    return sizes

"""The serving engine's picks beside the decoding steps (decoding/steps.py: prefill, decode,
pick_first, pick_next over the paged pool): the rows' sampling settings as arrays, and what some
requests add around a pick, each a step of its own run only where a row asks for it.

- `sampling_arrays`, `set_row`: the rows' sampling settings as arrays (the host's side of the picks).
- `write_tables`: set table entries (group, row, column) -> page, U at a time (padding: row R, dropped).
- `adjust_rows` before a pick (the logits `adjust`ed), `count_first` / `count_next` after it (the
  picked tokens counted for the penalties), `logprobs_first` / `logprobs_next` after it (the picked
  tokens' log-probabilities and the top alternatives', sampling.token_logprobs, of the logits picked
  from).
- `adjust`: what a request adds to its logits before sampling, in this order: its logit bias, its
  presence and frequency penalties (from the counts of each row's generated tokens below `counted`:
  harmony's special tokens, which frame the reply's messages, are not counted; kept on the devices
  [R, V] and added to by every adjusted pick; `set_counts` sets a row's when a request takes
  it), and its grammar's mask of allowed tokens (one bit a token, [B, ceil(V / 32)] int32, made on
  the host: constrain.py).

The sampling settings are held per row [R] on the devices, sent again only when a row changes
hands, and gathered by the picks. The picks are apart from the model steps so that the sampling's
`mode` (`sampling.rows_mode`) is chosen on the host for the rows at hand, without compiling the
model step three times or branching on the device; what some requests add (`wants`:
log-probabilities, adjusted logits) are steps apart again, so that a bucket compiles three picks
and three of those, not one pick for each combination, and a step whose rows ask for neither runs
the pick alone. Shapes depend only on (R, W, pool, P, C, B), so nothing compiles with the traffic.

Legend: R = rows, W = table width, P = prompts prefilled together, C = prefill chunk, B = rows
decoded together, V = vocab, U = table entries set together, K = logit bias entries (300).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..sampling import LOGIT_BIAS_MOST, token_logprobs
from ..training import lora
from ..sharding import everywhere


def sampling_arrays(n: int) -> tuple[np.ndarray, ...]:
    """(seeds, temperature, top_k, top_p, min_p [n], logit bias ids, biases [n, K], presence and
    frequency penalties [n]) of n idle rows: greedy, nothing biased (unused bias entries name no token,
    dropped); `set_row` gives a row a request's settings."""
    seed, temperature, top_k = np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32)
    top_p, min_p = np.ones(n, np.float32), np.zeros(n, np.float32)
    bias_ids = np.full((n, LOGIT_BIAS_MOST), np.iinfo(np.int32).max, np.int32)
    bias = np.zeros((n, LOGIT_BIAS_MOST), np.float32)
    presence, frequency = np.zeros(n, np.float32), np.zeros(n, np.float32)
    return seed, temperature, top_k, top_p, min_p, bias_ids, bias, presence, frequency


def set_row(arrays: tuple[np.ndarray, ...], i: int, settings) -> None:
    """Row i of sampling_arrays set to a request's Settings (OverflowError or ValueError for a value the
    arrays cannot hold: the request's own failure, never its neighbours')."""
    seed, temperature, top_k, top_p, min_p, bias_ids, bias, presence, frequency = arrays
    s = settings.sampling
    for name, value in (("seed", settings.seed), ("top_k", s.top_k)):  # (numpy 1 would wrap them silently)
        if not -2**31 <= value < 2**31:
            raise OverflowError(f"{name} {value} does not fit a 32-bit integer")
    seed[i], temperature[i], top_k[i] = settings.seed, s.temperature, s.top_k
    top_p[i], min_p[i] = s.top_p, s.min_p
    presence[i], frequency[i] = settings.presence_penalty, settings.frequency_penalty
    bias_ids[i], bias[i] = np.iinfo(np.int32).max, 0.0
    for j, (token, value) in enumerate(settings.logit_bias):
        bias_ids[i, j], bias[i, j] = token, value


COUNT_MOST = np.iinfo(np.int16).max  # a token's count saturates here (a penalty of 32,767 times)


def penalized(settings) -> bool:
    return bool(settings.presence_penalty or settings.frequency_penalty)


def adjusted(settings) -> bool:
    """Whether a request's logits are adjusted before sampling (`adjust`)."""
    return bool(settings.logit_bias) or penalized(settings) or settings.grammar is not None


def wants(settings) -> tuple[bool, bool]:
    """(whether any of these requests' Settings asks for log-probabilities, any for adjusted logits):
    which steps beside the pick its rows need."""
    return any(s.logprobs is not None for s in settings), any(adjusted(s) for s in settings)


def mask_words(vocab: int) -> int:
    """int32 words of one row's mask of allowed tokens (token t: bit t % 32 of word t // 32)."""
    return -(-vocab // 32)


def adjust(logits, rows, bias_ids, bias, presence, frequency, counts, mask):
    """logits [B, V] of rows [B] -> float32 [B, V]: each row's logit bias added (bias_ids, bias [R, K]),
    presence and frequency penalties [R] subtracted (once for a token generated at all, and once for
    every time: counts [R, V]), and the tokens its mask [B, words] leaves out at -inf."""
    B, V = logits.shape
    ids, values = jnp.take(bias_ids, rows, axis=0, mode="clip"), jnp.take(bias, rows, axis=0, mode="clip")
    logits = logits.astype(jnp.float32).at[jnp.arange(B)[:, None], ids].add(values, mode="drop")
    seen = jnp.take(counts, rows, axis=0, mode="clip").astype(jnp.float32)  # [B, V]
    logits = (logits - jnp.take(frequency, rows, mode="clip")[:, None] * seen
              - jnp.take(presence, rows, mode="clip")[:, None] * (seen > 0))
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, words, 32]
    return jnp.where(bits.reshape(B, -1)[:, :V] > 0, logits, -jnp.inf)


def _count(counts, rows, tokens, counted: int):
    """counts [R, V] with one more of each token [B] below `counted` in its row [B] (row R: dropped),
    saturating."""
    rows = jnp.where(tokens < counted, rows, counts.shape[0])
    now = counts.at[rows, tokens].get(mode="fill", fill_value=0).astype(jnp.int32)
    return counts.at[rows, tokens].set(jnp.minimum(now + 1, COUNT_MOST).astype(counts.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnames=("counts",))
def set_counts(counts, row, values):
    """counts [R, V] with row `row` set to values [V] (a request taking the row: its reply's counts)."""
    return counts.at[row].set(values)


def compiled_only(put, step, *args):
    """Compile the jitted `step` for these arguments without running it -> zeros in place of its outputs
    (their shapes and dtypes; put: a host array onto the devices as the engine's inputs are). A later
    `step(*args)` of the same shapes finds it compiled. (A warm-up's: a pick that sorts the vocabulary
    takes a CPU about half a second.)"""
    compiled = step.lower(*args).compile()
    return jax.tree.map(lambda out: put(np.zeros(out.shape, out.dtype)), compiled.out_info)


def in_parts(writes: list[tuple], size: int, padding: int):
    """Host writes (tuples of ints alike) as int32 arrays [len(tuple), size], one a call, padded with
    `padding` (a row past the end: the write is dropped)."""
    for at in range(0, len(writes), size):
        part = np.full((len(writes[0]), size), padding, np.int32)
        part[:, :len(writes[at:at + size])] = np.array(writes[at:at + size], np.int32).T
        yield part


@functools.partial(jax.jit, donate_argnames=("tables",))
def write_tables(tables, writes):
    """tables [2, R, W]; writes int32 [4, U]: groups, rows, columns, pages (row R: padding) -> tables."""
    return tables.at[writes[0], writes[1], writes[2]].set(writes[3], mode="drop")


@jax.jit
def set_entry(tables, index, entry):
    """The tables of served adapters (training/lora.tables_of) with entry `index` of each set to `entry`'s
    (training/lora.table_entry)."""
    return lora.set_entry(tables, index, entry)


@functools.partial(jax.jit, donate_argnames=("adapters",))
def set_adapter(adapters, row, adapter):
    """adapters [R] int32 (each row's served adapter, -1 none) with row's set."""
    return adapters.at[row].set(adapter)


@jax.jit
def adjust_rows(logits, plan, settings, counts, mask):
    """logits [N, V] of the rows plan[0] [N] -> float32 [N, V] as `adjust` leaves them, by each row's
    settings (sampling_arrays, on the devices), counts [R, V] and masks [N, words]."""
    bias_ids, bias, presence, frequency = settings[5:]
    return adjust(logits, plan[0], bias_ids, bias, presence, frequency, counts, mask)


@functools.partial(jax.jit, static_argnames=("mesh", "counted"), donate_argnames=("counts",))
def count_first(mesh, counts, plan, first, counted: int):
    """counts [R, V] with each finishing row's first token [P] (plan as decoding.steps.pick_first's) counted."""
    at = jnp.where(plan[3] > 0, plan[0], counts.shape[0])
    return everywhere(_count(counts, at, first, counted), mesh)


@functools.partial(jax.jit, static_argnames=("mesh",))
def logprobs_first(mesh, logits, plan, settings, first):
    """logits [P, V] the first tokens [P] were drawn from (plan as pick_first's) -> their
    log-probabilities [P], top ids [P, k], top log-probabilities [P, k] (sampling.token_logprobs)."""
    temperature = jnp.take(settings[1], plan[0], mode="clip")
    return tuple(everywhere(x, mesh) for x in token_logprobs(logits, temperature, first))


def _picked(plan, last):
    """(each running row of a decode plan [4, B], or R for padding: dropped) and its token in last [R]."""
    rows = plan[0]
    return jnp.where(plan[2] >= 0, rows, last.shape[0]), jnp.take(last, rows, mode="clip")


@functools.partial(jax.jit, static_argnames=("mesh", "counted"), donate_argnames=("counts",))
def count_next(mesh, counts, plan, last, counted: int):
    """counts [R, V] with each running row's token (last [R], as decoding.steps.pick_next left it) counted."""
    return everywhere(_count(counts, *_picked(plan, last), counted), mesh)


@functools.partial(jax.jit, static_argnames=("mesh",))
def logprobs_next(mesh, logits, plan, settings, last):
    """logits [B, V] the running rows' tokens (last [R], as decoding.steps.pick_next left it) were drawn from ->
    log-probabilities [R], top ids [R, k], top log-probabilities [R, k] by row: this step's rows set,
    the others zero."""
    at, tokens = _picked(plan, last)
    temperature = jnp.take(settings[1], plan[0], mode="clip")
    return tuple(everywhere(jnp.zeros((last.shape[0],) + x.shape[1:], x.dtype).at[at].set(x, mode="drop"), mesh)
                 for x in token_logprobs(logits, temperature, tokens))

"""Tolerances from the computation's own rounding noise, measured in the same test.

A float32 (or bfloat16) result is never compared with a constant such as 1e-5: two correct codes
that sum the same terms in another order differ by the rounding noise of those sums, which depends
on the inputs, the sizes and the machine's libraries, and a constant placed near it passes on one
machine and fails on the next. Instead each test computes

  exact   the same computation in float64 (the PyTorch references or a numpy definition), and
  noise   the largest |reference - exact| of an *independent* low-precision implementation of it
          (the reference, or the definition written in torch, run in float32), over the whole result,

and requires  max |ours - exact| <= NOISE_FACTOR * noise  for each of our paths under test. Our
paths are thereby also within 2 * NOISE_FACTOR * noise of each other (cached and uncached, sharded
and one device, micro-batched and whole), without a bound of their own.

Why NOISE_FACTOR = 8: codes summing in other orders (blockwise attention, experts grouped or split
across devices, gradients accumulated over micro-batches) make errors of the same size as the
reference's, not the same errors. Over the suite's 1,619 checks the largest ratio measured was
3.37 (GPTOSS_NOISE_LOG=file records each check's ratio; docs/testing.md has the figures), so 8
leaves a factor of 2 for other machines. A defect moves results much further: a dropped micro-batch or
the sink left out of the attention's denominator by 10^5 to 10^6 times the noise, RMSNorm's eps
off by 10x by 26x (the tests' docstrings name the mutations tried).

The noise is floored (NOISE_FLOOR), so that a reference that happens to be exact (a short sum of
exactly representable terms) does not make the bound zero: in float32 at 4 units in the last place
of the largest exact entry, far below the noise of any sum; in bfloat16 at one rounding of that
entry (half its unit in the last place, 2^-8 relative). Every bfloat16 result is rounded at least
once; 4 of its units (3% of the largest entry) would lie above the measured noise of a whole
bfloat16 attention block (1%), so the floor rather than the noise would set the bound.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

NOISE_FACTOR = 8.0
# The floor of the noise, relative to the largest exact entry, by the precision of the reference run.
NOISE_FLOOR = {"float32": 4 * float(np.finfo(np.float32).eps), "bfloat16": 2.0 ** -8}


@dataclasses.dataclass(frozen=True)
class Exact:
    """A float64 result and the low-precision noise of computing it (absolute, over the whole result)."""

    value: np.ndarray
    noise: float

    @classmethod
    def measure(cls, reference, exact, *, precision: str = "float32") -> Exact:
        """`reference`: an independent low-precision computation of `exact` (float64) on the same inputs."""
        exact = np.asarray(exact, np.float64)
        reference = np.asarray(reference, np.float64)
        assert reference.shape == exact.shape, (reference.shape, exact.shape)
        assert np.all(np.isfinite(exact)) and np.all(np.isfinite(reference))
        floor = NOISE_FLOOR[precision] * float(np.abs(exact).max())
        return cls(exact, max(float(np.abs(reference - exact).max()), floor))

    def __getitem__(self, index) -> Exact:
        """The same bound on a part of the result (a row, a position, a sequence)."""
        return Exact(self.value[index], self.noise)

    def check(self, actual, what: str = "", *, factor: float = NOISE_FACTOR) -> float:
        """Assert max|actual - exact| <= factor * noise; returns the ratio max|actual - exact| / noise."""
        actual = np.asarray(actual, np.float64)
        assert actual.shape == self.value.shape, (what, actual.shape, self.value.shape)
        assert np.all(np.isfinite(actual)), what
        ratio = float(np.abs(actual - self.value).max()) / self.noise
        _log(what, ratio)
        assert ratio <= factor, (f"{what}: max|actual - exact| = {ratio:.3g} x the reference's own noise "
                                 f"({self.noise:.3g}), over the bound of {factor:g}x")
        return ratio


def scalar(reference: float, exact: float, *, precision: str = "float32") -> Exact:
    """Exact.measure for one number (a loss)."""
    return Exact.measure(np.array([reference]), np.array([exact]), precision=precision)


def _log(what: str, ratio: float) -> None:
    path = os.environ.get("GPTOSS_NOISE_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(f"{ratio:.4f}\t{test}\t{what}\n")


def check_typical_tokens(ours, theirs, exact, what: str = "") -> None:
    """Whole-model bfloat16 logits [T, V]: ours against a bfloat16 reference run `theirs`, both against
    float64 `exact`, on the typical token. A max over tokens says little here: rare router near-ties
    pick another expert in bfloat16 (the references compute the router in bf16, we in float32). So
    our median per-token error (max over the vocabulary, relative to the token's largest logit) is
    at most 1.25x the reference's median, and our greedy tokens agree with float64's at least 0.95x
    as often as the reference's do."""
    ours, theirs, exact = (np.asarray(x, np.float64) for x in (ours, theirs, exact))

    def per_token(x):
        return np.abs(x - exact).max(-1) / np.abs(exact).max(-1)

    def agreement(x):
        return np.mean(x.argmax(-1) == exact.argmax(-1))

    ratio = float(np.median(per_token(ours)) / np.median(per_token(theirs)))
    _log(f"{what} (median per token)", ratio)
    assert ratio <= 1.25, f"{what}: median per-token error {ratio:.3g}x the bfloat16 reference's"
    assert agreement(ours) >= 0.95 * agreement(theirs), (what, agreement(ours), agreement(theirs))

"""An online model of engine step time, for adaptive pacing.

    t = a + b * decode_rows + c * P / 1e3 + d * sum(n * (start + n / 2)) / 1e6

where P is the step's prefill tokens and the last term is the attention work of its
prefill chunks (n new tokens each, starting at position `start`, attending to on average
start + n / 2 positions). The coefficients are a ridge-regularised least-squares fit over
sliding windows of measured steps, kept as running sums so an update costs O(16) and a
solve O(64) float operations: cheap enough for every scheduler step.

Every step the engine runs is fitted, a prompt's 8192-token steps with nobody decoding
included: they span the token axis that small mixed steps alone leave collinear with the
intercept. (On the H200, a fit of only the capped mixed steps, with a term for what a
mixed step costs over a decode step, split the two wrongly within a few steps: a 13 ms
mixed-step term next to a negative cost per token, and the target looked out of reach.)

Steps with prefill and steps without it have a window each. A stream decoding alone for
a while (the usual case between long prompts) then refreshes what a decode costs without
pushing out what a prefill chunk costs, and the next long prompt starts from a fit that
still knows it.

`prefill_budget()` inverts the model: the most prefill tokens (one chunk starting at
`start`) whose predicted step time stays within a target.

A step's time is not linear in its tokens where the GPU's matrix products are tiled: on an
H100 the 27B hybrid's mixed steps padded to the 256-token CUDA graph took 40 ms, as the line
predicts, and those padded to 320 took 51-56 ms where it predicted 42-48 (each row tile of a
product is a fixed amount of work; bench/results/hybrid/h100/run-33e8a15/). So the model also
keeps, for each CUDA-graph size a mixed step was padded to, that size's last SIZE_WINDOW steps,
and `excess(size)` says how far they came out above or below the line as it is now (the median
of their residuals, so one stalled step does not condemn a size, and computed when asked, so a
size's excess never goes stale while the line moves): the pacer steps down from a size whose
steps miss the target.

A size's excess is what it costs beside the other sizes, not beside a quiet machine: every
mixed step also moves a drift, the median of how far the latest mixed steps of every size came
out above the line, and each size's step keeps the drift it ran in; its residual counts less that
drift. On the H100 a 3.5 s slowdown made every mixed step ~45 ms whatever its size (16 prefill
tokens as dear as 255; bench/results/hybrid/h100/run-5b8f30f/): without the drift it condemned
every size in use, the cap fell to 15 tokens, and the sizes it left were never run again to
clear them (the long prompt took 9.6 s against 4.9). A size dearer than its neighbours (320
beside 256) still stands out: its steps run above the drift the others set.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

N_FEATURES = 4
# A weak prior (an H100/H200-class GPU running an 8B model) so the first solves are sane;
# measured steps outweigh it after a few samples.
PRIOR = (0.005, 0.0001, 0.02, 0.002)
PRIOR_WEIGHT = 1e-3
# The steps each CUDA-graph size's excess is measured over (the latest).
SIZE_WINDOW = 16
# The drift is the median residual of the latest DRIFT_STEPS mixed steps: one dear step does not
# move it (a 320 beside 256s), a slowdown does from its fifth step.
DRIFT_STEPS = 8
# A size's measured steps count for this many mixed steps (`measured`): a size a host-bound
# engine's cap stepped down from is run again once they have aged out (a host slowdown makes every
# size dear while it lasts).
RECENT_STEPS = 64


def features(decode_rows: int, chunks: list[tuple[int, int]]) -> tuple[float, ...]:
    """Features of one step; chunks are (start, n) of each prefill chunk scheduled."""
    tokens = sum(n for _, n in chunks)
    attention = sum(n * (start + n / 2) for start, n in chunks)
    return (1.0, float(decode_rows), tokens / 1e3, attention / 1e6)


def is_mixed(x: tuple[float, ...]) -> bool:
    """Did the step with these features run prefill next to decodes?"""
    return x[1] > 0 and x[2] > 0


class StepCostModel:
    def __init__(self, window: int = 256, decode_window: int = 64) -> None:
        # [steps without prefill, steps with prefill], each (features, seconds)
        self._windows: tuple[deque[tuple[tuple[float, ...], float]], ...] = (
            deque(maxlen=decode_window), deque(maxlen=window))
        self._xtx = [[0.0] * N_FEATURES for _ in range(N_FEATURES)]
        self._xty = [0.0] * N_FEATURES
        self._theta: tuple[float, ...] = PRIOR
        self._mixed = 0
        self._dirty = False
        # CUDA-graph size -> its latest mixed steps (features, seconds, the drift they ran in,
        # the count of mixed steps measured when they were)
        self._sizes: dict[int, deque[tuple[tuple[float, ...], float, float, int]]] = {}
        self._mixed_seen = 0
        self._residuals: deque[float] = deque(maxlen=DRIFT_STEPS)  # the latest mixed steps' residuals

    @property
    def samples(self) -> int:
        return sum(len(w) for w in self._windows)

    @property
    def mixed_samples(self) -> int:
        """Steps in the fit that ran prefill tokens next to decodes."""
        return self._mixed

    @property
    def coefficients(self) -> tuple[float, ...]:
        if self._dirty:
            self._theta = self._solve()
            self._dirty = False
        return self._theta

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * f for c, f in zip(self.coefficients, x))

    @property
    def drift(self) -> float:
        """How far the latest mixed steps, of every size, ran above the line at the time
        (seconds, the median of DRIFT_STEPS)."""
        return statistics.median(self._residuals) if self._residuals else 0.0

    def excess(self, size: int) -> float | None:
        """How far the latest mixed steps padded to CUDA-graph ``size`` ran above the line as
        fitted now, less the drift each ran in (seconds, the median), or None if no such step
        was measured."""
        steps = self._sizes.get(size)
        if not steps:
            return None
        theta = self.coefficients
        return statistics.median([y - sum(c * f for c, f in zip(theta, x)) - drift for x, y, drift, _ in steps])

    def measured(self, size: int) -> float | None:
        """What the mixed steps padded to CUDA-graph ``size`` took, of those among the latest
        RECENT_STEPS mixed steps (seconds, the median; None if none), for a host-bound engine,
        whose sizes the line cannot price. Only recent steps count: a size condemned in a
        slowdown is not run again to clear it, so its old steps must age out."""
        steps = self._sizes.get(size, ())
        recent = [y for _, y, _, seen in steps if seen > self._mixed_seen - RECENT_STEPS]
        return statistics.median(recent) if recent else None

    def size_measured(self) -> dict[int, float]:
        """``measured`` of every size with recent steps."""
        return {size: m for size in sorted(self._sizes) if (m := self.measured(size)) is not None}

    @property
    def largest_measured_size(self) -> int:
        """The largest CUDA-graph size a measured mixed step was padded to (0: none)."""
        return max(self._sizes, default=0)

    def size_excess(self) -> dict[int, float]:
        """``excess`` of every measured size."""
        return {size: self.excess(size) for size in sorted(self._sizes)}  # type: ignore[misc]

    def observe(self, x: tuple[float, ...], seconds: float, size: int | None = None) -> None:
        """A measured step; ``size``: the CUDA-graph size it was padded to (None: eager)."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if is_mixed(x):
            drift = self.drift
            self._mixed_seen += 1
            self._residuals.append(seconds - self.predict(x))
            if size is not None:
                self._sizes.setdefault(size, deque(maxlen=SIZE_WINDOW)).append((x, seconds, drift, self._mixed_seen))
        window = self._windows[x[2] > 0]
        if len(window) == window.maxlen:
            old_x, old_y = window[0]
            self._accumulate(old_x, old_y, -1.0)
        window.append((x, seconds))
        self._accumulate(x, seconds, 1.0)
        self._dirty = True

    def prefill_budget(self, target_s: float, decode_rows: int, start: int) -> float:
        """Largest n with predicted time of (decode_rows, one chunk (start, n)) <= target.

        Returns 0.0 when even an empty step is predicted over the target, and inf when
        the fitted prefill cost is not positive (the model has not seen prefill yet).
        """
        a, b, c, d = self.coefficients
        room = target_s - a - b * decode_rows
        if room <= 0:
            return 0.0
        # room = c * n / 1e3 + d * n * (start + n / 2) / 1e6, solved for n >= 0.
        quad = max(d, 0.0) / 2e6
        lin = c / 1e3 + max(d, 0.0) * start / 1e6
        if quad <= 0.0:
            return room / lin if lin > 0 else math.inf
        disc = lin * lin + 4 * quad * room
        return (-lin + math.sqrt(disc)) / (2 * quad)

    def _accumulate(self, x: tuple[float, ...], y: float, sign: float) -> None:
        if is_mixed(x):
            self._mixed += int(sign)
        for i in range(N_FEATURES):
            xi = sign * x[i]
            self._xty[i] += xi * y
            row = self._xtx[i]
            for j in range(N_FEATURES):
                row[j] += xi * x[j]

    def _solve(self) -> tuple[float, ...]:
        # (X^T X + w I) theta = X^T y + w prior, by Gaussian elimination with pivoting.
        m = [
            [self._xtx[i][j] + (PRIOR_WEIGHT if i == j else 0.0) for j in range(N_FEATURES)]
            + [self._xty[i] + PRIOR_WEIGHT * PRIOR[i]]
            for i in range(N_FEATURES)
        ]
        theta = solve_augmented(m, 1e-18)
        return self._theta if theta is None else tuple(theta)


def solve_augmented(m: list[list[float]], tiny: float) -> list[float] | None:
    """Solve the square system whose rows are ``m`` (coefficients, then the right-hand
    side) by Gauss-Jordan elimination with partial pivoting, in place; None when a pivot
    is not above ``tiny`` in magnitude (a singular system). Pure Python: the systems here
    are 3x3 and 4x4, solved once a step or once a slice."""
    k = len(m)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= tiny:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                for j in range(col, k + 1):
                    m[r][j] -= f * m[col][j]
    return [m[i][k] / m[i][i] for i in range(k)]

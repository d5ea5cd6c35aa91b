"""The draft-length policy of speculative decoding, and the measurements it decides by.

All of it is numbers: what a step costs, what a drafter's forward costs, what drafting bought,
and how many drafts each request feeds. The speculator (`strata.engine.speculative`) asks it and
tells it what happened.

  * `StepCost` — an online fit of step time, a + b * rows + c * prefill tokens, per batch size.
  * `DraftPolicy` — how many drafts each request feeds this step: a token is added while its
    expected acceptance (learned per request and per n-gram match length, or a DSpark drafter's
    confidence in each draft) buys more output per second than it costs (b, weighed against the
    step's a + b T). As the batch grows, the cost of a token grows relative to what it gains, and
    drafting stops on its own.
  * `DrafterCost` — one drafter forward's measured time (a draft model's per drafted depth, a
    block drafter's): a draft model's depth and a block drafter's blocks are cut where the step's
    tokens per second, those forwards included, is highest.
  * `DraftGuard` — what drafting actually bought, measured: per batch size, the output rate of
    steps that fed drafts against steps that did not (their prefill chunks' cost taken out).
    Where the model's choices measure slower, the policy stands down (so that turning
    speculation on does not make a busy server slower).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from strata.engine.policy import draft_pays

DEFAULT_PRIOR_ACCEPT = 0.5  # assumed per-token acceptance before anything is measured
PRIOR_WEIGHT = 4.0  # pseudo-trials the learned per-match-length rate counts for, against a request's own
MAX_SLOPE_GUESS = (
    32.0  # before the cost of a token is measured: a step of 33 tokens costs two of one
)
GUARD_DECAY = (
    0.95  # the guard's output rates forget at this rate per step of their batch size
)
GUARD_MIN_STEPS = 3.0  # (decayed) steps an arm needs before the guard compares it
EXPLORE_EVERY = (
    16  # steps (per batch size) an arm may go unseen before the guard takes it
)
EXPLORE_FIRST = (
    3  # until the plain arm is measured, one step in this many does not draft
)
MIN_FIT_STEPS = (
    8.0  # (decayed) steps a batch size needs before its own cost fit is used
)
DRAFTER_DECAY = 0.95  # the drafter's call-time fit forgets at this rate per call


class StepCost:
    """Step time t = a + b * rows + c * prefill_tokens (rows: decoding requests' tokens and drafted
    ones; prefill_tokens: the step's prefill chunks), fitted by least squares with forgetting, per
    batch size (decoding requests, by powers of two: the kernels a step runs change with its rows,
    so one line over every size would misprice a row) and over all steps for sizes seen too rarely.

    It runs every step on the scheduler's thread, so it is plain float arithmetic on 3 x 3 sums, and
    a bucket's solution is kept until the next observation (numpy's per-call overhead on arrays this
    small, twice a step, cost a one-row CPU step ~1%)."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        # bucket (None: all) -> decayed [X^T X rows (3 x 3), X^T t (3)]
        self.fits: dict[int | None, tuple[list[list[float]], list[float]]] = {}
        self._solved: dict[
            int, tuple[float, float, float]
        ] = {}  # bucket -> coefficients since the last observe

    def observe(
        self, num_decodes: int, rows: int, prefill_tokens: int, seconds: float
    ) -> None:
        x = (1.0, float(rows), float(prefill_tokens))
        d = self.decay
        for key in (None, batch_bucket(num_decodes)):
            fit = self.fits.get(key)
            if fit is None:
                fit = self.fits[key] = ([[0.0] * 3 for _ in range(3)], [0.0] * 3)
            xtx, xty = fit
            for i in range(3):
                row = xtx[i]
                for j in range(3):
                    row[j] = row[j] * d + x[i] * x[j]
                xty[i] = xty[i] * d + x[i] * seconds
        self._solved.clear()

    def coefficients(self, num_decodes: int) -> tuple[float, float, float]:
        """(a, b, c): seconds, seconds per row, seconds per prefill token at this batch size. Until
        the steps seen vary in rows enough to tell b, it is guessed as a / MAX_SLOPE_GUESS."""
        bucket = batch_bucket(num_decodes)
        solved = self._solved.get(bucket)
        if solved is None:
            solved = self._solved[bucket] = self._solve(bucket)
        return solved

    def _solve(self, bucket: int) -> tuple[float, float, float]:
        fit = self.fits.get(bucket)
        if fit is None or fit[0][0][0] < MIN_FIT_STEPS:
            fit = self.fits.get(None)
        if fit is None:
            return 0.0, 0.0, 0.0
        xtx, xty = fit
        w = xtx[0][0]
        mean_rows = xtx[0][1] / w
        ridge = (
            0.0,
            1e-6 * w,
            1e-6 * w,
        )  # keeps the system solvable where a feature never varies
        if xtx[1][1] / w - mean_rows * mean_rows > 1.0:
            ridged = [
                [xtx[i][j] + (ridge[i] if i == j else 0.0) for j in range(3)]
                for i in range(3)
            ]
            a, b, c = _solve_linear(ridged, xty)
            if a > 0 and b >= 0:
                return a, b, max(0.0, c)
        # rows barely vary: fit t = a' + c * prefill, then split a' = a + b * mean_rows by the guess
        a1, c = _solve_linear(
            [[xtx[0][0], xtx[0][2]], [xtx[2][0], xtx[2][2] + ridge[2]]],
            [xty[0], xty[2]],
        )
        a = max(a1, 0.0) / (1.0 + mean_rows / MAX_SLOPE_GUESS)
        return a, a / MAX_SLOPE_GUESS, max(0.0, c)


def _solve_linear(m: list[list[float]], y: list[float]) -> list[float]:
    """x with m x = y for a small nonsingular m (Gaussian elimination with partial pivoting)."""
    n = len(y)
    a = [list(row) + [y[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0.0:
            raise ValueError("singular system")
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][k] * x[k] for k in range(i + 1, n))) / a[i][i]
    return x


def batch_bucket(num_decodes: int) -> int:
    """Batch sizes by powers of two: 1, 2, 3-4, 5-8, ..., 33-64, ..."""
    return (max(1, num_decodes) - 1).bit_length()


class DrafterCost:
    """The time of one drafter forward, t = c0 + c1 * n for n requests, fitted by least squares
    with forgetting (`StepCost`'s method on one feature): a block drafter's forward, a draft model's
    forward per drafted depth. It is paid whether or not its drafts are verified, so the policy
    weighs it against what the drafts should add."""

    def __init__(self, decay: float = DRAFTER_DECAY):
        self.decay = decay
        self.sums = [0.0] * 5  # decayed weight, sum n, sum n^2, sum t, sum n t

    def observe(self, n: int, seconds: float) -> None:
        d = self.decay
        for i, x in enumerate((1.0, n, n * n, seconds, n * seconds)):
            self.sums[i] = self.sums[i] * d + x

    def seconds(self, n: int) -> float | None:
        """The expected time of a call for n requests (None: never measured)."""
        w, sn, snn, st, snt = self.sums
        if w <= 0:
            return None
        mean_n, mean_t = sn / w, st / w
        var = snn / w - mean_n * mean_n
        slope = max(0.0, (snt / w - mean_n * mean_t) / var) if var > 1e-6 else 0.0
        return max(0.0, mean_t + slope * (n - mean_n))


class DraftGuard:
    """Per batch size (decoding requests, by powers of two): the output rate — tokens the decoding
    requests yielded per second of decoding (a step's time less its prefill chunks' estimated cost)
    — of steps that fed drafts and of those that did not, decayed. Where drafting
    has measured slower than not, `allows` says no. An arm not seen for EXPLORE_EVERY steps is taken
    once (drafting where it is vetoed, plain where drafting wins), so both rates stay measured and a
    veto lifts when drafting pays again; steps that had nothing to draft count as plain ones, so
    where the drafter misses often enough, drafting never stands down to measure."""

    def __init__(self) -> None:
        self.arms: dict[
            tuple[int, bool], list[float]
        ] = {}  # (bucket, drafted) -> [tokens, seconds, steps]
        self.turns: dict[int, int] = {}
        self.seen: dict[
            tuple[int, bool], int
        ] = {}  # (bucket, drafted) -> the turn it was last observed or taken

    def observe(
        self, num_decodes: int, drafted: bool, tokens: int, seconds: float
    ) -> None:
        b = batch_bucket(num_decodes)
        arm = self.arms.setdefault((b, drafted), [0.0, 0.0, 0.0])
        d = GUARD_DECAY
        arm[0], arm[1], arm[2] = (
            arm[0] * d + tokens,
            arm[1] * d + seconds,
            arm[2] * d + 1.0,
        )
        self.seen[(b, drafted)] = self.turns.get(b, 0)

    def rate(self, num_decodes: int, drafted: bool) -> float | None:
        """Measured tokens per second of this arm at this batch size (None: too few steps yet)."""
        arm = self.arms.get((batch_bucket(num_decodes), drafted))
        if arm is None or arm[2] < GUARD_MIN_STEPS or arm[1] <= 0:
            return None
        return arm[0] / arm[1]

    def allows(self, num_decodes: int) -> bool:
        """Whether this step may feed the drafts the policy chooses (called once per step)."""
        b = batch_bucket(num_decodes)
        turn = self.turns[b] = self.turns.get(b, 0) + 1
        plain, drafted = self.rate(num_decodes, False), self.rate(num_decodes, True)
        if plain is None:
            return turn % EXPLORE_FIRST != 0  # measure the plain rate soon
        if drafted is None:
            return True
        prefer = drafted >= plain
        # the other arm is taken once EXPLORE_EVERY turns have passed without it being seen or taken:
        # steps that found nothing to draft, or whose drafts the policy declined, measure the plain
        # arm for free
        if turn - self.seen.get((b, not prefer), 0) >= EXPLORE_EVERY:
            self.seen[(b, not prefer)] = turn
            return not prefer
        return prefer


@dataclass
class Candidate:
    """One decoding request's proposal for this step."""

    key: object  # whatever the caller identifies the request by
    draft: list[int]
    match_len: int  # n-gram length that found it, < 0 in other requests' texts (0: the drafter has no notion of it)
    accept_rate: float  # estimated probability that each drafted token is accepted
    # the drafter's own estimate for each drafted token, given the ones before it were accepted (a
    # DSpark confidence head); None: accept_rate for every one
    confidences: list[float] | None = None

    def rate(self, j: int) -> float:
        """The probability that draft j is accepted once drafts 0 .. j - 1 were."""
        return self.accept_rate if self.confidences is None else self.confidences[j]


class DraftPolicy:
    """Chooses each request's draft length for one step (see the module docstring)."""

    def __init__(self, max_draft: int, adaptive: bool = True):
        self.max_draft = max_draft
        self.adaptive = adaptive
        self.cost = StepCost()
        self.guard = DraftGuard()
        # accepted / tried drafted tokens per n-gram match length, decayed
        self.by_match: dict[int, list[float]] = {}

    def accept_rate(self, history: tuple[float, float], match_len: int) -> float:
        """Per-token acceptance of a request's next draft: its own history (accepted, tried), pulled
        towards what drafts found by n-grams of this length achieved across requests. A draft from
        other requests' texts (match_len < 0) takes that alone: the request's history tells how its
        own text repeats, not how it follows another's."""
        prior = self._prior(match_len)
        return min(0.99, prior) if match_len < 0 else _blend(history, prior)

    def _prior(self, match_len: int | None) -> float:
        """What drafts found by n-grams of this length achieved (DEFAULT_PRIOR_ACCEPT where none yet)."""
        seen = None if match_len is None else self.by_match.get(match_len)
        acc, tried = seen if seen is not None else (0.0, 0.0)
        return (acc + DEFAULT_PRIOR_ACCEPT) / (tried + 1.0)

    def could_draft(
        self, histories: list[tuple[float, float]], base_tokens: int, num_decodes: int
    ) -> bool:
        """Whether `choose` could give any of these requests (their acceptance histories) a draft this
        step: the best rate any proposal of theirs could be estimated at (`accept_rate` with the best
        prior of any match length, a length not seen yet included) passes its first test. Where it
        cannot, the step's rows cost more than any draft could gain (a large batch), and nothing need
        be looked up."""
        if not self.adaptive:
            return True
        a, b, _ = self.cost.coefficients(num_decodes)
        prior = max(
            self._prior(m) for m in [*self.by_match, None]
        )  # None: a length not seen yet
        best = max(max(min(0.99, prior), _blend(h, prior)) for h in histories)
        return _pays(best, a, b, base_tokens, float(max(num_decodes, 1)))

    def allows(self, num_decodes: int) -> bool:
        """Whether this step of num_decodes decoding requests may draft at all: the guard's say, asked
        once per step before any draft is looked up (a vetoed step spends nothing on drafting)."""
        return not self.adaptive or self.guard.allows(num_decodes)

    def choose(
        self,
        candidates: list[Candidate],
        base_tokens: int,
        num_decodes: int,
        budget: int,
    ) -> list[int]:
        """Draft lengths (<= len(draft), summing to <= budget), in the order of `candidates`.

        base_tokens: rows of the step without drafts (its decoding requests; a prefill chunk in the
        step makes it longer, which only makes a drafted row relatively cheaper, so leaving it out
        errs towards drafting less); num_decodes: requests that yield a token (the step's output
        without drafts). A drafted token at depth j of a request with acceptance p is expected to
        add p^j tokens of output (with the drafter's confidences c_i, the product of c_0 .. c_(j-1));
        tokens are taken best first while (E + gain) / t(T + 1) > E / t(T),
        (the guard's veto comes before, in `allows`)."""
        lengths = [0] * len(candidates)
        if not self.adaptive:
            for i, c in enumerate(candidates):
                lengths[i] = min(len(c.draft), self.max_draft, max(0, budget))
                budget -= lengths[i]
            return lengths
        if not candidates:
            return lengths
        a, b, _ = self.cost.coefficients(num_decodes)
        heap = [(-c.rate(0), i, 1) for i, c in enumerate(candidates) if c.draft]
        heapq.heapify(heap)
        expected, tokens = float(max(num_decodes, 1)), base_tokens
        while heap and budget > 0:
            neg_gain, i, depth = heapq.heappop(heap)
            gain = -neg_gain
            if not _pays(gain, a, b, tokens, expected):
                break  # gains only shrink from here
            lengths[i] = depth
            expected += gain
            tokens += 1
            budget -= 1
            c = candidates[i]
            if depth < min(len(c.draft), self.max_draft):
                heapq.heappush(heap, (-(gain * c.rate(depth)), i, depth + 1))
        return lengths

    def record(self, match_len: int, drafted: int, accepted: int) -> None:
        """Learn from one verification: `accepted` of `drafted` tokens kept; a rejection was seen
        unless all were kept."""
        stats = self.by_match.setdefault(match_len, [0.0, 0.0])
        stats[0] = stats[0] * 0.99 + accepted
        stats[1] = stats[1] * 0.99 + accepted + (accepted < drafted)


def _blend(history: tuple[float, float], prior: float) -> float:
    """A request's own acceptance (accepted, tried) pulled towards `prior` by PRIOR_WEIGHT pseudo-trials."""
    own_acc, own_tried = history
    return min(0.99, (own_acc + PRIOR_WEIGHT * prior) / (own_tried + PRIOR_WEIGHT))


def _pays(gain: float, a: float, b: float, tokens: int, expected: float) -> bool:
    """Whether one more drafted row worth `gain` expected tokens raises the step's output rate,
    the step taking a + b T for T rows (`draft_pays`)."""
    return draft_pays(gain, expected, a + b * tokens, b)


def expected_tokens(c: Candidate) -> float:
    """The tokens a candidate's whole draft is expected to add: the sum over its depths of the
    chance that every draft up to there is accepted."""
    total, p = 0.0, 1.0
    for j in range(len(c.draft)):
        p *= c.rate(j)
        total += p
    return total

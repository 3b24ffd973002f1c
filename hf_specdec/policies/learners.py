"""Full-information online learners over N experts (drafters). Pure Python.

Each round the learner gives a distribution `weights()` over experts, then sees the whole loss
vector (every expert's loss in [0, 1]) through `update(losses)`. The instantaneous regret of
expert i is r_i = <weights, losses> - losses[i]; R_i is its running sum.
"""
from __future__ import annotations

import math
from typing import Sequence


class Learner:
    def __init__(self, num_experts: int):
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        self.num_experts = num_experts
        self.rounds = 0

    def weights(self) -> list[float]:
        raise NotImplementedError

    def update(self, losses: Sequence[float]) -> None:
        if len(losses) != self.num_experts:
            raise ValueError(f"expected {self.num_experts} losses, got {len(losses)}")
        self.rounds += 1
        self._update(list(map(float, losses)))

    def _update(self, losses: list[float]) -> None:
        raise NotImplementedError

    def _mixture_loss(self, losses: list[float]) -> float:
        return sum(w * x for w, x in zip(self.weights(), losses))


def _normalise_logs(logs: list[float]) -> list[float]:
    top = max(logs)
    exps = [math.exp(x - top) for x in logs]
    total = sum(exps)
    return [x / total for x in exps]


class Hedge(Learner):
    """Exponential weights w_i ∝ exp(-eta_t L_i) on cumulative losses L_i; anytime rate
    eta_t = sqrt(8 ln N / t) unless `eta` is given."""

    def __init__(self, num_experts: int, eta: float | None = None):
        super().__init__(num_experts)
        if eta is not None and not (isinstance(eta, (int, float)) and eta > 0):
            raise ValueError(f"Hedge(eta) must be a number > 0 or None, got {eta!r}")
        self.eta = eta
        self.cumulative = [0.0] * num_experts

    def weights(self) -> list[float]:
        eta = self.eta or math.sqrt(8 * math.log(max(self.num_experts, 2)) / max(self.rounds, 1))
        return _normalise_logs([-eta * x for x in self.cumulative])

    def _update(self, losses):
        self.cumulative = [c + x for c, x in zip(self.cumulative, losses)]


def normalhedge_scale(regrets: Sequence[float]) -> float:
    """c > 0 with mean_i exp([R_i]_+^2 / 2c) = e (Chaudhuri et al. 2009); 0 if no R_i > 0.

    The left side falls with c; it is >= e at c = max^2 / (2 (1 + ln N)) (the largest term alone
    reaches N e) and <= e at c = max^2 / 2, so bisection on that bracket converges.
    """
    positive = [max(r, 0.0) for r in regrets]
    top = max(positive)
    if top <= 0:
        return 0.0
    n = len(positive)
    squares = [r * r for r in positive if r > 0]
    zeros = n - len(squares)

    def excess(c: float) -> float:  # log(mean exp(.)) - 1, computed stably
        logs = [s / (2 * c) for s in squares]
        m = max(logs)
        total = sum(math.exp(x - m) for x in logs) + zeros * math.exp(-m)
        return m + math.log(total / n) - 1.0

    lo, hi = top * top / (2 * (1 + math.log(n))), top * top / 2
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


class _RegretLearner(Learner):
    """Weights from the running regrets R_i, recomputed after each update; uniform when no
    expert has weight (e.g. before any positive regret)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.regrets = [0.0] * num_experts
        self._weights = [1.0 / num_experts] * num_experts

    def weights(self) -> list[float]:
        return list(self._weights)

    def _set_weights(self, logs: list[float]) -> None:
        """Weights ∝ exp(logs); -inf everywhere means uniform."""
        if all(x == -math.inf for x in logs):
            self._weights = [1.0 / self.num_experts] * self.num_experts
        else:
            self._weights = _normalise_logs(logs)


class NormalHedge(_RegretLearner):
    """Parameter-free NormalHedge: p_i ∝ [R_i]_+ / c · exp([R_i]_+^2 / 2c); uniform while no
    expert has positive regret."""

    def _update(self, losses):
        mixture = self._mixture_loss(losses)
        self.regrets = [r + mixture - x for r, x in zip(self.regrets, losses)]
        c = normalhedge_scale(self.regrets)
        self._set_weights([math.log(r / c) + r * r / (2 * c) if r > 0 else -math.inf for r in self.regrets])


class AdaNormalHedge(_RegretLearner):
    """AdaNormalHedge (Luo & Schapire 2015): p_i ∝ Φ(R_i + 1, C_i + 1) - Φ(R_i - 1, C_i + 1) with
    Φ(R, C) = exp([R]_+^2 / 3C), C_i = Σ |r_i| (uniform prior)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.magnitudes = [0.0] * num_experts

    def _update(self, losses):
        mixture = self._mixture_loss(losses)
        for i, x in enumerate(losses):
            self.regrets[i] += mixture - x
            self.magnitudes[i] += abs(mixture - x)

        def phi(r: float, c: float) -> float:
            return max(r, 0.0) ** 2 / (3 * c)

        # w_i = exp(phi(R+1)) - exp(phi(R-1)) = exp(a) (1 - exp(b - a)), a = phi(R+1) >= b = phi(R-1)
        logs = []
        for r, c in zip(self.regrets, self.magnitudes):
            a, b = phi(r + 1, c + 1), phi(r - 1, c + 1)
            logs.append(a + math.log(-math.expm1(b - a)) if a > b else -math.inf)
        self._set_weights(logs)


LEARNERS = {"normalhedge": NormalHedge, "hedge": Hedge, "adanormalhedge": AdaNormalHedge}

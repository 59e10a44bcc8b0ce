"""Per-role step-time model: the offline profile as a prior, refined online from the workers' own steps.

Each role's step time is linear in three features (the form of types.PerformanceProfile):

    prefill  seconds = c0 + c1 * n + c2 * n^2                    features (1, n, n^2), n = tokens in the step
    decode   seconds = c0 + c1 * batch + c2 * context_tokens     features (1, batch, context_tokens)

The fit is a maximum a posteriori estimate with the profile as the prior mean, over N = sum_i w_i samples:

    minimise  sum_i w_i (y_i - c . x_i)^2                           the samples
            + (W / N) sum_i w_i ((c - c_profile) . x_i)^2           the profile, as W samples like these
            + UNEXCITED_SHARE * W |(c - c_profile) * scale|^2       the profile where no sample reaches
    subject to c >= 0

The second term (a g-prior) makes W = `prior_weight` read as "the profile counts as W samples": in every
direction the samples determine, the estimate is N / (N + W) of the way from the profile to the samples'
own least-squares fit, however collinear 1, n and n^2 are over the sampled range. The third term, small,
keeps what the samples cannot tell (a decode pool that always runs batches of ~40 says nothing about
batch 200's slope apart from its intercept) at the profile; `scale` is a representative magnitude of
each feature (1; a full prefill token budget or decode batch; its square, or a full batch of budget-long
contexts), and features are divided by it so the solve is well conditioned.

Each update that brings samples multiplies the weight w_i of every earlier sample by `forgetting`, so the
model follows a worker whose speed drifts; a window without samples changes nothing.

The non-negative solve is exact: every subset of the three coefficients is tried free (the others pinned
at 0) and the feasible candidate with the lowest objective wins. The objective is strictly convex, so its
constrained optimum is the unconstrained optimum of one such face.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.common.validation import require
from splitserve.planner.core.types import DecodeStepSample, PerformanceProfile, PrefillStepSample

UNEXCITED_SHARE = 1e-5
"""Fraction of prior_weight that holds the profile in directions the samples do not excite."""


@dataclass(frozen=True)
class FitConfig:
    """How strongly the profile holds and how fast old samples fade."""

    prior_weight: float = 20.0
    """The profile's weight, in samples (see the module docstring); > 0."""
    forgetting: float = 0.8
    """Each update with samples multiplies the weight of all earlier samples by this; in (0, 1]."""

    def __post_init__(self) -> None:
        require(self.prior_weight > 0 and math.isfinite(self.prior_weight),
                f"prior_weight must be a finite number > 0, got {self.prior_weight}")
        require(0 < self.forgetting <= 1, f"forgetting must be in (0, 1], got {self.forgetting}")


@dataclass(frozen=True)
class LinearFit:
    """One role's step-time fit with its sufficient statistics.

    Invariants: prior, scales, moment and coefficients have k entries; gram has k*k (row-major); gram and
    moment are in normalised features (x / scales); count >= 0; coefficients are in natural units, >= 0."""

    prior: tuple[float, ...]
    """Coefficients from the profile (natural units)."""
    scales: tuple[float, ...]
    """Representative magnitude of each feature (all > 0)."""
    gram: tuple[float, ...]
    """Forgetting-weighted sum of x x^T over the samples seen."""
    moment: tuple[float, ...]
    """Forgetting-weighted sum of x * seconds over the samples seen."""
    count: float
    """Forgetting-weighted number of samples seen (N)."""
    coefficients: tuple[float, ...]
    """The current estimate (equals `prior` until a sample arrives)."""

    @classmethod
    def seeded(cls, prior: tuple[float, ...], scales: tuple[float, ...]) -> LinearFit:
        size = len(prior)
        require(len(scales) == size and all(s > 0 for s in scales), "need one scale > 0 per coefficient")
        return cls(prior, scales, (0.0,) * (size * size), (0.0,) * size, 0.0, prior)

    def update(self, features: np.ndarray, seconds: np.ndarray, fit: FitConfig) -> LinearFit:
        """The fit after also seeing these samples. features: [samples, k] natural units; seconds: [samples]."""
        if len(seconds) == 0:
            return self
        scales = np.asarray(self.scales)
        size = len(scales)
        normalised = features / scales
        gram = fit.forgetting * np.asarray(self.gram).reshape(size, size) + normalised.T @ normalised
        moment = fit.forgetting * np.asarray(self.moment) + normalised.T @ seconds
        count = fit.forgetting * self.count + len(seconds)
        solution = map_estimate(gram, moment, count, np.asarray(self.prior) * scales, fit.prior_weight)
        return LinearFit(self.prior, self.scales, tuple(gram.ravel().tolist()), tuple(moment.tolist()), count,
                         tuple((solution / scales).tolist()))

    def seconds(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds for features [..., k] (natural units)."""
        return features @ np.asarray(self.coefficients)


def map_estimate(gram: np.ndarray, moment: np.ndarray, count: float, prior: np.ndarray,
                 prior_weight: float) -> np.ndarray:
    """The module docstring's objective in normalised features: gram [k, k], moment [k], prior [k]; count > 0."""
    share = prior_weight / count
    ridge = UNEXCITED_SHARE * prior_weight * np.eye(len(moment))
    return nonnegative_quadratic(gram * (1 + share) + ridge, moment + (share * gram + ridge) @ prior)


def nonnegative_quadratic(hessian: np.ndarray, linear: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} c^T hessian c - 2 linear . c, exactly, for a positive definite hessian [k, k] (see the
    module docstring); returns [k] with every entry >= 0."""
    size = len(linear)
    best, best_objective = np.zeros(size), 0.0  # all pinned at 0: objective 0
    for free_count in range(1, size + 1):
        for free in itertools.combinations(range(size), free_count):
            index = list(free)
            face = np.linalg.solve(hessian[np.ix_(index, index)], linear[index])
            objective = -float(linear[index] @ face)  # c^T H c - 2 g . c at the face optimum H c = g
            if np.all(face >= 0) and objective < best_objective:
                best, best_objective = np.zeros(size), objective
                best[index] = face
    return best


def prefill_features(tokens: np.ndarray) -> np.ndarray:
    """[n] tokens per step -> [n, 3] features (1, n, n^2)."""
    tokens = np.asarray(tokens, dtype=float)
    return np.stack([np.ones_like(tokens), tokens, tokens * tokens], axis=-1)


def decode_features(batch_size: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
    """[n] batch sizes and [n] context totals -> [n, 3] features (1, batch, context_tokens)."""
    batch_size = np.asarray(batch_size, dtype=float)
    return np.stack([np.ones_like(batch_size), batch_size, np.asarray(context_tokens, dtype=float)], axis=-1)


@dataclass(frozen=True)
class PerformanceModel:
    """Step times of both roles. Pure: `update` returns a new model; the same samples give the same model."""

    prefill: LinearFit
    decode: LinearFit
    max_batch_size: int
    """Decode batch limit of one worker."""
    prefill_token_budget: int
    """Tokens one prefill step computes at most: a longer prompt takes ceil(n / budget) steps."""
    fit: FitConfig = field(default_factory=FitConfig)

    @classmethod
    def from_profile(cls, profile: PerformanceProfile, fit: FitConfig | None = None) -> PerformanceModel:
        budget, batch = float(profile.prefill_token_budget), float(profile.max_batch_size)
        prefill = LinearFit.seeded(
            (profile.prefill_fixed_s, profile.prefill_s_per_token, profile.prefill_s_per_token2),
            (1.0, budget, budget * budget))
        decode = LinearFit.seeded(
            (profile.decode_fixed_s, profile.decode_s_per_request, profile.decode_s_per_context_token),
            (1.0, batch, batch * budget))
        return cls(prefill, decode, profile.max_batch_size, profile.prefill_token_budget, fit or FitConfig())

    def update(self, prefill_steps: Sequence[PrefillStepSample],
               decode_steps: Sequence[DecodeStepSample]) -> PerformanceModel:
        prefill = self.prefill.update(prefill_features([s.num_tokens for s in prefill_steps]),
                                      np.array([s.seconds for s in prefill_steps], dtype=float), self.fit)
        decode = self.decode.update(
            decode_features([s.batch_size for s in decode_steps], [s.context_tokens for s in decode_steps]),
            np.array([s.seconds for s in decode_steps], dtype=float), self.fit)
        return PerformanceModel(prefill, decode, self.max_batch_size, self.prefill_token_budget, self.fit)

    def prompt_seconds(self, uncached_tokens: np.ndarray) -> np.ndarray:
        """Seconds one prefill worker spends on prompts of these uncached lengths (each >= 1), alone.

        A prompt longer than the token budget is chunked: ceil(n / budget) steps pay the fixed cost, and the
        per-token and quadratic (attention) terms are charged on the whole prompt."""
        tokens = np.asarray(uncached_tokens, dtype=float)
        fixed, per_token, per_token2 = self.prefill.coefficients
        chunks = np.ceil(tokens / self.prefill_token_budget)
        return chunks * fixed + per_token * tokens + per_token2 * tokens * tokens

    def local_prefill_stall_s(self, uncached_tokens: int) -> float:
        """Seconds a prefill of this many tokens adds to a decode worker's step it rides in (no fixed cost:
        the decode step pays that already)."""
        _, per_token, per_token2 = self.prefill.coefficients
        return per_token * uncached_tokens + per_token2 * uncached_tokens * uncached_tokens

    def decode_step_seconds(self, batch_size: float, context_tokens: float) -> float:
        return float(self.decode.seconds(decode_features([batch_size], [context_tokens]))[0])

    def as_profile(self) -> PerformanceProfile:
        """The current coefficients in the profile's form (for reports and for seeding another model)."""
        p0, p1, p2 = self.prefill.coefficients
        d0, d1, d2 = self.decode.coefficients
        return PerformanceProfile(p0, p1, p2, d0, d1, d2, self.max_batch_size, self.prefill_token_budget)

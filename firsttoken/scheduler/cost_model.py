"""A step's wall time predicted from what it holds, fitted online from the engine's own step
timings.

    seconds = c_step + c_seq * sequences + c_sample * sampled rows
            + c_prefill * prefill tokens + c_prefill_attn * prefill attention pairs
            + c_decode * decode tokens + c_decode_ctx * decode context tokens
            + c_patch * encoder patches + c_encoder_attn * encoder attention pairs

Attention is super-linear: a prefill chunk of q new tokens over c cached ones scores q * (c + (q +
1) / 2) query-key pairs, a vision block over n patches n^2 (per window for windowed blocks: the
family's EncoderUnit says). Every term is work the step really does, so coefficients are seconds per
unit of work on this machine, model and dtype: they are fitted, not configured.

Fitting: ridge-regularised least squares over a sliding window of recent steps, each weighted by 1 /
actual^2 (the error that matters is relative: predicted / actual), pulled towards a prior (the
start-up calibration's fit, or zero), with coefficients kept non-negative (an active set: a negative
one is pinned to zero and the rest refitted). Refitted every ``refit_every`` observations. Pure
Python and numpy: no tensors, cheap enough for every step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from firsttoken.batch import StepFeatures

MIN_SAMPLES = 16  # observations before an uncalibrated model prices steps (fewer fit mostly noise)
# Typical magnitudes of each feature, so the regularisation treats coefficients on comparable
# scales.
_SCALES = {
    "step": 1.0,
    "sequences": 8.0,
    "sampled": 8.0,
    "prefill_tokens": 512.0,
    "prefill_attention": 512.0 * 1024.0,
    "decode_tokens": 8.0,
    "decode_context": 8.0 * 1024.0,
    "encoder_patches": 4096.0,
    "encoder_attention": 4096.0 * 4096.0,
}


FEATURE_NAMES: tuple[str, ...] = ("step", *(f.name for f in fields(StepFeatures)))


def prefill_chunk(num_new: int, context: int, samples: bool) -> StepFeatures:
    return StepFeatures(sequences=1, sampled=int(samples), prefill_tokens=num_new,
                        prefill_attention=num_new * (context + (num_new + 1) / 2))


def decode_chunk(context: int) -> StepFeatures:
    return StepFeatures(sequences=1, sampled=1, decode_tokens=1, decode_context=context)


def encoder_units(num_patches: int, attention_pairs: float) -> StepFeatures:
    return StepFeatures(encoder_patches=num_patches, encoder_attention=attention_pairs)


@dataclass(frozen=True)
class Fit:
    """A fitted model's coefficients (seconds per unit of each feature) and how well it predicts."""

    coefficients: tuple[float, ...]  # FEATURE_NAMES order
    num_samples: int

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURE_NAMES, self.coefficients))


class CostModel:
    def __init__(
        self,
        prior: tuple[float, ...] | None = None,
        window: int = 512,
        refit_every: int = 8,
        ridge: float = 1e-3,
    ) -> None:
        if prior is not None and len(prior) != len(FEATURE_NAMES):
            raise ValueError(f"prior needs {len(FEATURE_NAMES)} coefficients")
        self.scales = np.array([_SCALES[n] for n in FEATURE_NAMES])
        self.prior = np.zeros(len(FEATURE_NAMES)) if prior is None else np.array(prior, dtype=float)
        self.coef = self.prior.copy()
        self.window = window
        self.refit_every = refit_every
        self.ridge = ridge
        self._x: deque[np.ndarray] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.num_observed = 0
        # predicted / actual of each observation, made with the coefficients of that moment (an
        # honest error)
        self.ratios: deque[float] = deque(maxlen=window)
        # term -> steps in the window with it, its largest value
        self.coverage: dict[str, dict[str, float]] = {}
        # bumped whenever the coefficients may change (refit, reset): caches of prices key on it
        self.version = 0

    def reset(self) -> None:
        """Forget every observation and go back to the prior."""
        self._x.clear()
        self._y.clear()
        self.ratios.clear()
        self.coverage = {}
        self.coef = self.prior.copy()
        self.num_observed = 0
        self._since_fit = 0
        self.version += 1

    @property
    def is_fitted(self) -> bool:
        return bool(self.coef.any())

    @property
    def is_trained(self) -> bool:
        """Fit enough to schedule by: a calibrated prior, or MIN_SAMPLES steps observed."""
        return bool(self.prior.any()) or self.num_observed >= MIN_SAMPLES

    def predict(self, features: StepFeatures) -> float:
        return float(features.vector() @ self.coef)

    def work_s(self, features: StepFeatures) -> float:
        """Predicted seconds of ``features`` as part of a step: without the per-step constant, paid
        once a step."""
        return self.predict(features) - float(self.coef[0])

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """One step ran ``features`` in ``seconds``."""
        if seconds <= 0 or features.is_empty:
            return
        x = features.vector()
        if self.is_fitted:
            self.ratios.append(float(x @ self.coef) / seconds)
        self._x.append(x)
        self._y.append(seconds)
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every or not self.is_fitted:
            self.refit()

    def refit(self) -> Fit:
        self._since_fit = 0
        self.version += 1
        if self._x:
            x = np.array(self._x)
            self.coef = fit_coefficients(x, np.array(self._y), self.prior, self.scales, self.ridge)
            # what the fit has seen, per term: a price for work far beyond it is an extrapolation
            # (the simulator says so when it prices a workload with it)
            self.coverage = {
                name: {"steps": int(n), "max": float(m)}
                for name, n, m in zip(FEATURE_NAMES[1:], (x[:, 1:] != 0).sum(0), x[:, 1:].max(0))
            }
        return self.fit()

    def fit(self) -> Fit:
        return Fit(tuple(float(c) for c in self.coef), len(self._y))


def fit_coefficients(
    x: np.ndarray,  # [n, d] features (first column the intercept)
    y: np.ndarray,  # [n] seconds
    prior: np.ndarray,  # [d]
    scales: np.ndarray,  # [d] typical feature magnitudes
    ridge: float,
) -> np.ndarray:
    """Non-negative, relative-error, ridge-to-prior least squares (see the module docstring)."""
    w = 1.0 / np.maximum(y, 1e-6)  # relative error: residual / actual
    xs = x / scales  # features in typical magnitudes (~1), so coefficients are all of one order
    a = xs * w[:, None]
    b = y * w
    p = prior * scales
    free = np.ones(x.shape[1], dtype=bool)
    theta = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        af = a[:, free]
        lam = ridge * max(1, len(y))
        lhs = af.T @ af + lam * np.eye(int(free.sum()))
        rhs = af.T @ b + lam * p[free]
        sol = np.linalg.solve(lhs, rhs)
        theta = np.zeros(x.shape[1])
        theta[free] = sol
        if (sol >= 0).all():
            break
        # pin negative coefficients to zero, refit the rest
        free[np.flatnonzero(free)[sol < 0]] = False
    return np.maximum(theta, 0.0) / scales  # back to seconds per unit of each feature

"""The log-normal distribution, fitted to a median and a 90th percentile.

Request lengths and outage durations are published as a median and a tail percentile, not as the
parameters of a distribution. A log-normal is fixed by two quantiles: if ln X ~ N(mu, sigma²) then

    median = exp(mu)                    so  mu    = ln(median)
    p90    = exp(mu + z90 · sigma)      so  sigma = ln(p90 / median) / z90,   z90 = Φ⁻¹(0.9) ≈ 1.28155

and its mean is exp(mu + sigma² / 2), always above the median: the longer the tail, the more so.
"""

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

Z90 = NormalDist().inv_cdf(0.9)  # 1.2815515655446004


@dataclass(frozen=True)
class LogNormal:
    mu: float  # mean of ln X
    sigma: float  # standard deviation of ln X

    @classmethod
    def from_median_p90(cls, median: float, p90: float) -> "LogNormal":
        if not 0 < median < p90:
            raise ValueError(f"a log-normal needs 0 < median < p90, got median {median} and p90 {p90}")
        return cls(math.log(median), math.log(p90 / median) / Z90)

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    @property
    def mean(self) -> float:
        return math.exp(self.mu + self.sigma**2 / 2)

    def quantile(self, p: float) -> float:
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(p))

    def sample(self, rng: random.Random) -> float:
        return rng.lognormvariate(self.mu, self.sigma)

"""The registry every rollwise metric is defined in, the histogram buckets they share, and a histogram
that takes many equal observations at once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)


class CountedHistogram(Histogram):
    """A histogram that also takes many equal observations at once: the learner reports how many tokens
    it trained at each staleness, and observing them one by one would cost a call per token."""

    def observe_many(self, amount: float, count: int) -> None:
        """The same samples as `count` calls of `observe(amount)` (no exemplar)."""
        if count <= 0:
            return
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        for i, bound in enumerate(self._upper_bounds):
            if amount <= bound:
                self._buckets[i].inc(count)
                break


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REWARD_BUCKETS = (-1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20)
RATIO_BUCKETS = (0.9, 0.99, 0.999, 0.9997, 1.0, 1.0004, 1.001, 1.01, 1.1)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

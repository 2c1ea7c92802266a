"""Every Prometheus metric rollwise exports, defined once (docs/metrics.md is generated from here), by
subject in this package's modules and all read as `metrics.NAME`.

One scrape target: the supervisor's /metrics. Child processes (the learner) report events over their
stdout pipe and the supervisor records them here, so a restarted child can never make a counter go
backwards and there is no shared multiprocess directory to clean up. The engine (embedded or SGLang)
exports its own /metrics as a separate target.

Naming: rollwise_<area>_<what>_<unit>, base units, `_total` counters (prometheus_client appends it),
low-cardinality labels only: env, reason, cause, kind, status, engine, component, phase.
"""

from __future__ import annotations

from pipeline.supervisor.observability.metrics.code_sandbox import *  # noqa: F403
from pipeline.supervisor.observability.metrics.episodes import *  # noqa: F403
from pipeline.supervisor.observability.metrics.episodes import init_episode_label_values
from pipeline.supervisor.observability.metrics.evaluation import *  # noqa: F403
from pipeline.supervisor.observability.metrics.learner import *  # noqa: F403
from pipeline.supervisor.observability.metrics.learner import init_learner_label_values
from pipeline.supervisor.observability.metrics.operations import *  # noqa: F403
from pipeline.supervisor.observability.metrics.registry import *  # noqa: F403


def init_label_values(*, envs: tuple[str, ...] | list[str], engines: tuple[str, ...] | list[str]) -> None:
    """Create every known label combination of episodes, engines, groups and the learner at zero (the
    evaluation's, the long run's and the service's have init functions of their own)."""
    init_episode_label_values(envs=envs, engines=engines)
    init_learner_label_values()

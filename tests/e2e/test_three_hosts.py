"""The three machines of docs/scale_out.md on hosts of their own (network namespaces, a directory each,
nothing shared but the network), every connection through the tests' fault proxy: trajectories over
Arrow Flight, weights over HTTP, an engine added and drained at run time, TLS on every door, and the
network made hostile (latency, drops, resets, a throttled weight link, partitions). After each: the
soak's books (nothing lost, nothing trained twice) and the run going on by itself. Root only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.tools.hosts import hostile_network
from pipeline.tools.hosts.namespaces import sweep_stale, unavailable
from pipeline.tools.hosts.private_ca import OPENSSL
from pipeline.tools.hosts.three_hosts import SECRETS, FleetOnHosts

_why_not = unavailable()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(_why_not is not None, reason=_why_not or ""),
    pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed"),
]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[FleetOnHosts]:
    sweep_stale()
    with FleetOnHosts(tmp_path) as f:
        f.start()
        yield f


def assert_books_hold(fleet: FleetOnHosts) -> None:
    books = fleet.books()
    assert books.ok, books.problems
    assert books.trained > 0 and books.trained_twice == []


def test_three_hosts_train_over_tls_add_and_drain_an_engine_and_no_secret_crosses_in_clear(
    fleet: FleetOnHosts,
) -> None:
    fleet.wait_steps(2, timeout_s=300)
    # Each host routes only the namespaces' own subnet: nothing can leave for the real network.
    for host in ("sup", "learner", "eng1"):
        assert all(line.startswith("10.77.0.0/24") for line in fleet.net.routes(host)), fleet.net.routes(host)

    fleet.start_engine("eng2")
    added = fleet.rollwise_engines("add", fleet.engine_url("eng2"))
    assert added.returncode == 0, added.stderr
    listed = json.loads(fleet.rollwise_engines("list").stdout)
    assert fleet.engine_url("eng2") in {e["url"] for e in listed}
    before = fleet.proxy.routes["eng2"].bytes_forwarded
    fleet.wait_steps(2, timeout_s=300)
    assert fleet.proxy.routes["eng2"].bytes_forwarded > before  # the new engine got work

    drained = fleet.rollwise_engines("drain", fleet.engine_url("eng2"))
    assert drained.returncode == 0, drained.stderr
    fleet.wait_steps(1, timeout_s=300)

    assert fleet.stop() == 0, fleet.tail()
    assert_books_hold(fleet)
    for route in ("eng1", "eng2", "flight", "weights"):
        assert fleet.proxy.routes[route].bytes_forwarded > 0, route
    assert {name: fleet.proxy.seen(secret) for name, secret in SECRETS.items()} == dict.fromkeys(SECRETS, 0)


@pytest.mark.slow
def test_a_hostile_network_costs_time_but_loses_nothing_and_the_run_resumes_by_itself(
    fleet: FleetOnHosts,
) -> None:
    """`rollwise bench hosts`'s faults one after the other on one run: latency, drops and resets, a
    throttled weight link, the learner's host and then the engine's host partitioned for 30 s (the
    shortest partition the issue names; the bench's default is 35 s)."""
    args = hostile_network.parse(["--steps", "3", "--partition-s", "30"])
    names = list(hostile_network.SCENARIOS)
    outcomes = dict(zip(names, hostile_network.run_scenarios(fleet, names, args), strict=True))
    for outcome in outcomes.values():
        assert outcome.resume_s is not None and outcome.resume_s < 30.0, outcome
    for name in ("latency", "drops", "throttle"):  # slower, never stalled
        assert outcomes[name].steps_during >= 3 and outcomes[name].longest_gap_s < 60.0, outcomes[name]
    # A partition stops the training while it lasts, and says so once, and once more when it is over.
    learner_said = " | ".join(outcomes["learner-cut"].messages)
    assert "the spool service" in learner_said and "is unreachable" in learner_said, learner_said
    assert "answers again after" in learner_said, learner_said
    engine_said = " | ".join(outcomes["engine-cut"].messages)
    assert "no engine answers" in engine_said and "engines serve again" in engine_said, engine_said
    assert fleet.stop() == 0, fleet.tail()
    assert_books_hold(fleet)
    assert {name: fleet.proxy.seen(secret) for name, secret in SECRETS.items()} == dict.fromkeys(SECRETS, 0)

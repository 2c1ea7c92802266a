"""Dashboards and the metrics catalogue: generated artefacts match the code, and every panel is usable."""

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pipeline.supervisor.observability import metrics
from pipeline.tools import catalogue as metrics_catalogue

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
UNITS = {"none", "short", "percentunit", "ops", "reqps", "s", "bytes"}


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate", ROOT / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def test_committed_dashboards_equal_the_generator_output() -> None:
    rendered = _generator().render_all()
    committed = {p.name: p.read_text() for p in DASHBOARD_DIR.glob("*.json")}
    assert (
        set(rendered)
        == set(committed)
        == {"overview.json", "learner.json", "engine.json", "reliability.json"}
    )
    for name, text in rendered.items():
        assert committed[name] == text, f"{name} is stale: run grafana/generate.py"


@pytest.mark.parametrize("name", ["overview.json", "learner.json", "engine.json", "reliability.json"])
def test_dashboard_lint(name: str) -> None:
    dash = _dashboards()[name]
    assert dash["schemaVersion"] >= 39  # Grafana 11
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert "instance" in variables
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    graphs = [p for p in panels if p["type"] != "row"]
    assert graphs
    for p in graphs:
        where = f"{name}: panel {p['title']!r}"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["fieldConfig"]["defaults"].get("unit") in UNITS, where
        assert p["description"], where
        assert p["targets"], where
        for t in p["targets"]:
            assert t["expr"].strip(), where
            # ratios are computed in PromQL over any window, never pre-baked rate windows
            assert "[$__rate_interval]" in t["expr"] or "rate(" not in t["expr"], where


def test_every_rollwise_metric_in_dashboards_exists_in_the_code() -> None:
    exported = set()
    for m in vars(metrics).values():
        if isinstance(m, metrics.Counter):
            exported.add(m._name + "_total")
        elif isinstance(m, metrics.Histogram):
            exported |= {m._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(m, metrics.Gauge):
            exported.add(m._name)
    for name, dash in _dashboards().items():
        for p in dash["panels"]:
            for t in p.get("targets", []):
                for used in re.findall(r"\brollwise_[a-z0-9_]+", t["expr"]):
                    assert used in exported, f"{name}: {used} is not a metric the code exports"


def test_metrics_catalogue_is_current() -> None:
    doc = ROOT / "docs" / "metrics.md"
    assert doc.read_text() == metrics_catalogue.render(), "run python -m pipeline.tools.catalogue"


def test_metric_names_follow_conventions() -> None:
    for m in vars(metrics).values():
        if isinstance(m, (metrics.Counter, metrics.Gauge, metrics.Histogram)):
            assert m._name.startswith("rollwise_"), m._name
            assert not m._name.endswith("_total"), m._name
            assert not set(m._labelnames) & {"episode_id", "group_id", "rid"}, m._name

"""The alerting rules (grafana/alerts.py -> grafana/alerts/*.yml): committed files match the generator,
promtool accepts them and every case passes (each alert fires on its synthetic series and stays quiet on
the others), they read only metrics the code exports, and each has its runbook line in docs/monitoring.md."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from pipeline.supervisor.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
ALERT_DIR = ROOT / "grafana" / "alerts"
PROMTOOL = shutil.which("promtool")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_alerts", ROOT / "grafana" / "alerts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed: `make test` installs Debian's prometheus package")
        pytest.skip("promtool not installed (Debian's prometheus package ships it; `make test` installs it)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=ALERT_DIR, timeout=120)


def test_committed_rule_files_equal_the_generator_output() -> None:
    rendered = _generator().render_all()
    assert set(rendered) == {p.name for p in ALERT_DIR.glob("*.yml")}
    for name, text in rendered.items():
        assert (ALERT_DIR / name).read_text() == text, f"{name} is stale: run grafana/alerts.py"


def test_promtool_accepts_the_rules() -> None:
    checked = _promtool("check", "rules", "rollwise.rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_on_its_cases_and_stays_quiet_on_the_others() -> None:
    tested = _promtool("test", "rules", "rollwise.rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_prometheus_config_loads_the_rules() -> None:
    config = yaml.safe_load((ROOT / "grafana" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts/rollwise.rules.yml"]
    assert (ROOT / "grafana" / config["rule_files"][0]).is_file()
    checked = _promtool("check", "config", str(ROOT / "grafana" / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    alerts = _generator().ALERTS
    assert len(alerts) >= 20
    for alert in alerts:
        assert any(case.fires for case in alert.cases), alert.name
        assert any(not case.fires for case in alert.cases), alert.name
        assert alert.severity in ("critical", "warning"), alert.name


def _exported() -> set[str]:
    names = set()
    for m in vars(metrics).values():
        if isinstance(m, metrics.Counter):
            names.add(m._name + "_total")
        elif isinstance(m, metrics.Histogram):
            names |= {m._name + s for s in ("_bucket", "_sum", "_count")}
        elif isinstance(m, metrics.Gauge):
            names.add(m._name)
    return names


def test_rules_read_only_metrics_the_code_exports() -> None:
    rules = yaml.safe_load((ALERT_DIR / "rollwise.rules.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exported = _exported()
    for group in rules["groups"]:
        for rule in group["rules"]:
            for used in re.findall(r"\brollwise[_:][a-z0-9_:]+", rule["expr"]):
                assert used in exported or used in recorded, (
                    f"{rule.get('alert', rule.get('record'))}: {used}"
                )


def test_every_alert_has_its_runbook_line_in_the_monitoring_doc() -> None:
    doc = (ROOT / "docs" / "monitoring.md").read_text()
    assert "## Alert runbook" in doc
    for line in _generator().runbook_lines():
        assert line in doc, f"docs/monitoring.md lacks (or has an outdated) runbook line:\n{line}"

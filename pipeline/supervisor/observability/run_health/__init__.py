"""The run-health advisor (docs/design/run_health.md): one view of a run (run_view), pure checks on it
(health_checks), findings ranked (findings); served by `rollwise doctor` (pipeline.tools.doctor) and the
daemon's `GET /doctor` (advisor)."""

"""Commands that read runs or measure the pipeline (bench, inspect, eval, report, the metrics catalogue).
Never imported by the daemon, the engine or the learner."""

"""`rollwise` console script.

Every subcommand imports its implementation lazily, so `rollwise config show` never imports torch.
Tools with their own flags (engine serve, env check, bench ...) own their argument parsing: this
module only routes `rollwise <command> ...` to `<module>.main(argv)`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# command words -> (module, function, one-line help). The function takes the remaining argv.
_DELEGATES: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("model", "init"): (
        "learner.model.model_init",
        "main",
        "write a Qwen3-architecture model + tokenizer preset",
    ),
    ("engine", "serve"): (
        "pipeline.engine.serve",
        "main",
        "serve the embedded SGLang-compatible engine",
    ),
    ("engine", "fetch-agent"): (
        "pipeline.transport.weights_http",
        "main",
        "download published weights over HTTP for an engine that does not share the run dir",
    ),
    ("engines",): (
        "pipeline.supervisor.fleet.admin",
        "main",
        "list, add or drain engines of a running daemon",
    ),
    ("envs",): ("envs.discovery", "main_list", "list installed environments"),
    ("env", "check"): ("envs.checker", "main", "run the environment checker on NAME"),
    ("bench", "logprobs"): (
        "pipeline.tools.bench.logprob_memory",
        "main",
        "chunked vs naive sampled-token log-probs",
    ),
    ("bench", "engine"): (
        "pipeline.tools.bench.engine_throughput",
        "main",
        "embedded engine tokens/s vs sequential",
    ),
    ("bench", "actors"): (
        "pipeline.tools.bench.runner_overhead",
        "main",
        "episode runner turns/s vs a bare aiohttp loop",
    ),
    ("bench", "async"): ("pipeline.tools.bench.async_speedup", "main", "learner steps/hour, eta=2 vs eta=0"),
    ("bench", "sync"): (
        "pipeline.tools.bench.sync_latency",
        "main",
        "weight publish -> version served latency",
    ),
    ("bench", "learner"): (
        "pipeline.tools.bench.learner_step",
        "main",
        "learner step memory and time per precision",
    ),
    ("bench", "publish"): (
        "pipeline.tools.bench.publish_overlap",
        "main",
        "learner steps/hour, weight writes inline vs in the background",
    ),
    ("bench", "mismatch"): (
        "pipeline.tools.bench.mismatch_clip",
        "main",
        "engine vs learner log-probs on a real model: ratio spread, GSPO clip with and without correction",
    ),
    ("bench", "http1"): (
        "pipeline.tools.bench.http1_parser",
        "main",
        "the engine client's HTTP/1.1 reply parser vs httptools (llhttp), microseconds per reply",
    ),
    ("bench", "transport"): (
        "pipeline.tools.bench.flight_rate",
        "main",
        "groups/s and MB/s through Arrow Flight vs the local spool reader",
    ),
    ("bench", "soak"): (
        "pipeline.tools.bench.soak",
        "main",
        "hours of the default task: resources, chaos, books",
    ),
    ("bench", "sandbox"): (
        "pipeline.tools.bench.sandbox_latency",
        "main",
        "sandboxed python executions/s vs subprocess.run",
    ),
    ("bench", "lora"): (
        "pipeline.tools.bench.lora_cost",
        "main",
        "LoRA vs full weights: memory, bytes, publish -> served",
    ),
    ("bench", "hosts"): (
        "pipeline.tools.hosts.hostile_network",
        "main",
        "three hosts (network namespaces) through latency, drops, a throttle, partitions; root only",
    ),
    ("report",): (
        "pipeline.tools.report",
        "main",
        "render key metrics of a run to PNG (no Grafana needed)",
    ),
    ("eval",): ("pipeline.tools.offline_eval", "main", "score a published version on held-out tasks"),
    ("doctor",): ("pipeline.tools.doctor", "main", "what is wrong with a run, ranked, with the evidence"),
    ("inspect",): ("pipeline.tools.inspect.web", "main", "browse a run's trajectories token by token"),
    ("bench", "learn"): (
        "pipeline.tools.bench.learning_curve",
        "main",
        "held-out success per minute over seeds, mean and 95% interval",
    ),
    ("bench", "moe"): (
        "pipeline.tools.bench.moe_comparison",
        "main",
        "MoE toy: GRPO, GRPO + routing replay, GSPO over seeds (routing change, clipping, success)",
    ),
    ("bench", "trl"): (
        "pipeline.tools.bench.trl_compare",
        "main",
        "rollwise vs TRL's GRPOTrainer (GSPO): minutes to held-out success, evaluation off the clock",
    ),
}


def _add_config_args(p: argparse.ArgumentParser, default: str = "built-in defaults") -> None:
    p.add_argument("--config", help=f"TOML config file (default: {default})")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. learner.optim.lr=3e-3",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollwise",
        description="Asynchronous online RL for agentic multi-turn LLM tasks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="other commands (each has its own --help):\n"
        + "\n".join(f"  {' '.join(words):<16} {h}" for words, (_, _, h) in _DELEGATES.items()),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon (actors, engine, learner) until stopped")
    _add_config_args(
        run,
        default="examples/guess_number.toml, the CPU recipe of `make run`; with --set and no --config, the "
        "built-in defaults",
    )
    run.add_argument("--run-dir", help="run directory; an existing one is resumed")
    run.add_argument("--max-steps", type=int, help="stop after this many learner steps")
    run.add_argument("--log-format", choices=["auto", "rich", "json"], help="progress output")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = config_sub.add_parser("show", help="print the effective config with every default")
    _add_config_args(show)

    for words, (_, _, help_text) in _DELEGATES.items():
        if len(words) == 1:
            sub.add_parser(words[0], help=help_text, add_help=False)
    for group in sorted({w[0] for w in _DELEGATES if len(w) == 2}):
        sub.add_parser(group, help=f"{group} tools: " + ", ".join(w[1] for w in _DELEGATES if w[0] == group))
    return parser


def _find_delegate(argv: Sequence[str]) -> tuple[Callable[[list[str]], int], list[str]] | None:
    for words, (module, func, _) in _DELEGATES.items():
        if tuple(argv[: len(words)]) == words:
            fn = getattr(importlib.import_module(module), func)
            return fn, list(argv[len(words) :])
    return None


def _config_show(ns: argparse.Namespace) -> int:
    from pipeline.contracts.config import ConfigError, config_to_toml, load_config

    try:
        cfg = load_config(ns.config, ns.set)
    except ConfigError as e:
        print(f"rollwise: {e}", file=sys.stderr)
        return 2
    print(config_to_toml(cfg), end="")
    return 0


def _unknown_subcommand(argv: Sequence[str]) -> str | None:
    """`rollwise GROUP WORD ...` where GROUP has subcommands and WORD is none of them (argparse would
    print the group's help for `GROUP WORD --help` and exit 0): the message naming WORD, else None."""
    if len(argv) < 2 or argv[1].startswith("-"):
        return None
    known = [w[1] for w in _DELEGATES if len(w) == 2 and w[0] == argv[0]]
    if known and argv[1] not in known:
        return f"unknown {argv[0]} command {argv[1]!r}; known: {', '.join(known)}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    delegate = _find_delegate(args)
    if delegate is not None:
        fn, rest = delegate
        return int(fn(rest) or 0)
    unknown = _unknown_subcommand(args)
    if unknown is not None:
        print(f"rollwise: {unknown}", file=sys.stderr)
        return 2

    parser = _build_parser()
    ns = parser.parse_args(args)
    if ns.command == "run":
        from pipeline.supervisor.daemon import main_run

        return int(main_run(ns))
    if ns.command == "config" and ns.config_command == "show":
        return _config_show(ns)
    if ns.command in {w[0] for w in _DELEGATES}:
        choices = ", ".join(" ".join(w) for w in _DELEGATES if w[0] == ns.command)
        parser.error(f"'{ns.command}' needs a subcommand: {choices}")
    parser.print_help()
    return 0 if ns.command is None else 2


if __name__ == "__main__":
    sys.exit(main())

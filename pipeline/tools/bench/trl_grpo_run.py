"""The TRL side of `rollwise bench trl`: TRL's own GRPOTrainer with GSPO settings on rollwise's task, its
policy kept every `--snapshot-every-s` seconds of training time for scoring after the run.

    python -m pipeline.tools.bench.trl_grpo_run --model DIR --tasks FILE --env NAME --env-options JSON
        --out DIR --minutes M --launched-at EPOCH [--snapshot-every-s 30] [--seed 0] [--max-new-tokens 48]
        [--threads 2] [--lr 2e-6] [--prompts-per-step 2] [--generations 8] [--temperature 1.0]
        [--max-steps N]

Run by `pipeline.tools.bench.trl_compare` in a process of its own, in the repository root, by the Python
that has TRL (`pip install -e '.[trl]'`). It imports none of rollwise's heavy modules: besides TRL it needs
only the environment's plugin (`envs`, no torch), whose own `step` is the reward, and the bench's snapshot
bookkeeping (`learning_curve`: standard library only).

- Model: the HF directory `--model` (the one rollwise's preset builds), full fine-tuning in fp32.
- Tasks: `--tasks`, one JSON line per task in rollwise's training order: {"prompt": the messages rollwise's
  runner sends (the env's reset, its system prompt if any), "task": the env's Task}; not shuffled.
- Reward: the env itself, reset on the task and stepped once with the completion's text (single-turn envs
  only): the episode outcome rollwise's learner trains on.
- GRPOConfig (GSPO settings): importance_sampling_level="sequence", loss_type="dapo", beta=0,
  epsilon=3e-4, epsilon_high=4e-4; lr `--lr` (constant, no warm-up), `--prompts-per-step` prompts x
  `--generations` completions per optimizer step, one update per generation batch, temperature
  `--temperature`, `--max-new-tokens` completion tokens, fp32 on the CPU, no gradient checkpointing,
  `--threads` torch threads.
- Clock: wall seconds since `--launched-at` (the bench's launch of this process, so imports and model
  loading count, as the daemon's start does for rollwise) less the time spent saving snapshots. At each
  snapshot point (`learning_curve.cadence_index`) the model is saved after the step (bf16 safetensors
  and the tokenizer's files, `--out`/snapshots/s<step>) and listed in `--out`/snapshots/manifest.jsonl;
  point 0 is `--model` itself. The policy at the time limit (`--minutes`) is that of the last step that
  ended before it, as rollwise's is its last version published before it: a step is also saved when the
  next one, as long as this one, would end past the limit, and training stops at the first step that
  ends past it (that step's policy is not kept).

Stdout's last line: {"steps", "train_s", "save_s", "snapshots"}. TRL's logs: `--out`/trl_log.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.tools.bench.learning_curve import MANIFEST, SNAPSHOTS, Snapshot, append_manifest, cadence_index

# Files of the base model directory the snapshots copy as they are (the weights and config are saved).
_SAVED = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}


def grpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """GRPOConfig's keyword arguments (TRL 1.16's names) for the module docstring's settings."""
    per_step = args.prompts_per_step * args.generations
    return {
        "output_dir": str(Path(args.out) / "trainer"),
        # GSPO: sequence-level importance ratio, its clip band, no KL term, DAPO's token aggregation
        "importance_sampling_level": "sequence",
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        # one optimizer step = prompts_per_step prompts x generations completions, generated for it
        "per_device_train_batch_size": per_step,
        "gradient_accumulation_steps": 1,
        "num_generations": args.generations,
        "num_iterations": 1,
        "max_completion_length": args.max_new_tokens,
        "temperature": args.temperature,
        "shuffle_dataset": False,
        # full fine-tuning in fp32 on the CPU
        "bf16": False,
        "fp16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def read_tasks(path: Path) -> list[dict[str, Any]]:
    """The dataset rows: `prompt` (messages) and `task` (the env's Task as a JSON string)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        rows.append({"prompt": item["prompt"], "task": json.dumps(item["task"])})
    if not rows:
        raise ValueError(f"{path} holds no tasks")
    return rows


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a string, or conversational [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def env_reward(env_name: str, options: dict[str, Any]) -> Callable[..., list[float]]:
    """TRL's reward function: each completion scored by the environment rollwise trains on (reset on its
    task, one step with the completion's text; the episode's outcome, 0 when the env wants more turns)."""
    from envs.api import Action, Task
    from envs.discovery import resolve_env

    factory = resolve_env(env_name)

    async def score(task_json: str, text: str) -> float:
        env = factory(**options)
        try:
            await env.reset(Task(**json.loads(task_json)))
            result = await env.step(Action(text=text))
        finally:
            await env.close()
        return float(result.outcome) if result.done and result.outcome is not None else 0.0

    async def score_all(tasks: Sequence[str], texts: Sequence[str]) -> list[float]:
        return list(await asyncio.gather(*(score(t, x) for t, x in zip(tasks, texts, strict=True))))

    def reward(prompts: Any, completions: Sequence[Any], task: Sequence[str], **_: Any) -> list[float]:
        return asyncio.run(score_all(task, [completion_text(c) for c in completions]))

    reward.__name__ = "env_outcome"  # TRL names its reward metrics after the function
    return reward


class Stopwatch:
    """The training clock: wall seconds since `launched_at` less the seconds spent saving snapshots."""

    def __init__(self, launched_at: float, clock: Callable[[], float] = time.time) -> None:
        self.launched_at = launched_at
        self.clock = clock
        self.saving_s = 0.0

    def training_s(self) -> float:
        return self.clock() - self.launched_at - self.saving_s


def save_snapshot(model: Any, base: Path, target: Path) -> None:
    """`model`'s weights in bf16 (safetensors) and config into `target`, beside the base directory's
    other files (tokenizer, chat template): an HF directory rollwise's engine serves."""
    import torch

    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(str(target), state_dict=state)
    for file in base.iterdir():
        if file.is_file() and file.name not in _SAVED and not (target / file.name).exists():
            shutil.copyfile(file, target / file.name)


def snapshot_callback(opts: argparse.Namespace, watch: Stopwatch, snapshots: Path) -> Any:
    """The TrainerCallback that keeps the policy at the cadence and stops training at `--minutes`."""
    from transformers import TrainerCallback

    limit_s = opts.minutes * 60.0

    class KeepSnapshots(TrainerCallback):
        def __init__(self) -> None:
            self.taken = 0
            self.kept = 0
            self.last_end = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.last_end = watch.training_s()
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            now = watch.training_s()
            step_s, self.last_end = now - self.last_end, now
            if now >= limit_s:  # ended past the time limit: the policy at the limit is the one before
                control.should_training_stop = True
                return control
            last = opts.max_steps > 0 and state.global_step >= opts.max_steps
            index = cadence_index(now, opts.snapshot_every_s)
            # The next step would likely end past the limit: this policy may be the one at the limit.
            if index > self.taken or now + step_s >= limit_s or last:
                self.taken = index
                started = time.time()
                target = snapshots / f"s{state.global_step}"
                save_snapshot(kwargs["model"], Path(opts.model), target)
                spent = time.time() - started
                watch.saving_s += spent
                append_manifest(
                    snapshots, Snapshot(at_s=now, path=str(target), step=state.global_step, save_s=spent)
                )
                self.kept += 1
            if last:
                control.should_training_stop = True
            return control

    return KeepSnapshots()


def log_callback(path: Path, watch: Stopwatch) -> Any:
    """TRL's logged metrics (reward, loss, clip ratios ...) as JSON lines with the training clock."""
    from transformers import TrainerCallback

    class LogLines(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            logs = kwargs.get("logs") or {}
            line = {"step": state.global_step, "train_s": round(watch.training_s(), 3), **logs}
            with path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line, default=str) + "\n")
            return control

    return LogLines()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trl_grpo_run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--tasks", required=True, type=Path, help="JSON lines: prompt (messages) and task")
    p.add_argument("--env", required=True, help="the rollwise environment that scores completions")
    p.add_argument("--env-options", default="{}", help="its options as JSON")
    p.add_argument("--out", required=True, type=Path, help="snapshots/, trl_log.jsonl, trainer/")
    p.add_argument("--minutes", required=True, type=float, help="training time, snapshot saving left out")
    p.add_argument("--launched-at", type=float, help="epoch seconds the clock starts at (default: now)")
    p.add_argument("--snapshot-every-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps too (-1: none)")
    args = p.parse_args(list(argv))
    if args.minutes <= 0 or args.snapshot_every_s <= 0 or args.threads < 1 or args.generations < 2:
        p.error("--minutes and --snapshot-every-s must be > 0, --threads >= 1, --generations >= 2")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    watch = Stopwatch(args.launched_at if args.launched_at is not None else time.time())
    import importlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # By name: mypy then reads the same code whether or not the optional extra is installed.
    trl, datasets = importlib.import_module("trl"), importlib.import_module("datasets")
    GRPOConfig, GRPOTrainer, Dataset = trl.GRPOConfig, trl.GRPOTrainer, datasets.Dataset
    torch.set_num_threads(args.threads)
    snapshots = args.out / SNAPSHOTS
    if (snapshots / MANIFEST).exists():
        print(f"trl_grpo_run: {snapshots / MANIFEST} exists already: use a fresh --out", file=sys.stderr)
        return 2
    append_manifest(snapshots, Snapshot(at_s=0.0, path=str(Path(args.model).resolve()), step=0))
    rows = read_tasks(args.tasks)
    steps_in_data = len(rows) // args.prompts_per_step
    if args.max_steps < 0:
        args.max_steps = steps_in_data  # the time limit stops it first
    elif args.max_steps > steps_in_data:
        print(
            f"trl_grpo_run: --max-steps {args.max_steps} needs more than {len(rows)} tasks", file=sys.stderr
        )
        return 2
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    keep = snapshot_callback(args, watch, snapshots)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=env_reward(args.env, json.loads(args.env_options)),
        args=GRPOConfig(**grpo_settings(args)),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[keep, log_callback(args.out / "trl_log.jsonl", watch)],
    )
    trainer.train()
    summary = {
        "steps": int(trainer.state.global_step),
        "train_s": round(watch.training_s(), 3),
        "save_s": round(watch.saving_s, 3),
        "snapshots": keep.kept,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

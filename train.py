"""Train a policy with GRPO. Every flag comes from grpo/config.py's GRPOConfig (see --help).

    python train.py --preset smoke                              # tiny local model, CPU, about a minute
    python train.py --model Qwen/Qwen2.5-0.5B-Instruct          # the GSM8K recipe on one GPU
    python train.py --resume runs/grpo                          # continue the latest complete checkpoint
    torchrun --nproc-per-node 4 train.py --model ...            # 4 processes (docs/distributed.md)
"""

from __future__ import annotations

import json
import logging
import os
import sys

from grpo.cli import config_from_args, resume_command


def run_summary(config, reward_names: list[str], problems: int, task: str, steps: int, resumed_at: int | None,
                processes: int, distributed: str, device, precision: str) -> str:
    """The run in five lines: model, data, rewards, steps and hardware, the output folder (every setting is in
    the folder's run_config.json)."""
    settings = f" {json.dumps(config.task_settings)}" if config.task_settings else ""
    micro_batches = config.completions_per_step // processes // config.micro_batch_size
    resumed = f", resumed at step {resumed_at}" if resumed_at is not None else ""
    return "\n".join([
        f"model:   {config.model}",
        f"data:    {config.dataset}{settings} [{config.train_split}]: {problems} problems ({task})",
        f"rewards: {', '.join(reward_names)}",
        f"steps:   {steps}{resumed}; each {config.prompts_per_step} prompts x {config.num_generations} completions of "
        f"up to {config.max_completion_length} tokens, {micro_batches} micro-batch(es) per update per process; "
        f"{processes} process(es) ({distributed}) on {device}, {precision}",
        f"output:  {config.output_dir} (every setting in run_config.json)",
    ])


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(argv, description=__doc__)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    from data import DataError
    from grpo.models import ModelError
    from grpo.core.checkpoint import latest_checkpoint
    from grpo.core.trainer import DiskFullError, Trainer, TrainingError
    from grpo.errors import PluginError
    from rewards import RewardError

    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 prints
    try:
        trainer = Trainer(config)
        if main_process:
            rewards = [spec.name if spec.weight == 1 else f"{spec.name}:{spec.weight:g}" for spec in trainer.rewards]
            print(run_summary(config, rewards, len(trainer.data.train_rows), trainer.data.task,
                              trainer.loop.total_steps, trainer.step if trainer.run.resume_from else None,
                              trainer.world.size, trainer.models.distributed, trainer.models.device,
                              trainer.processes.precision))
        result = trainer.train()
        trainer.close()
    except TrainingError as error:  # mid-run (a full disk, a plug-in's or a reward's fault, too many bad steps):
        flags = sys.argv[1:] if argv is None else argv  # nothing is lost, the run goes on from its last checkpoint
        start_over = config.resume is None and latest_checkpoint(config.output_dir) is None  # none was saved yet
        command = resume_command(flags, config.output_dir, "RANK" in os.environ, start_over)
        advice = "Free some space, then " if isinstance(error, DiskFullError) else "Once fixed, "
        advice += "run it again (no checkpoint was saved yet)" if start_over else "resume"
        print(f"error: {error} {advice} with: {command}", file=sys.stderr)
        return 1
    except (ValueError, DataError, ModelError, RewardError, PluginError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if not main_process:
        return 143 if result["status"] == "interrupted" else 0
    if result["first_reward"] is not None:
        print(f"mean reward: first step {result['first_reward']:.4f} -> last step {result['last_reward']:.4f}")
    print(f"run folder: {config.output_dir}  (curves: python -m grpo.plot {config.output_dir})")
    if result["status"] == "interrupted":
        return 130 if result["signal"] == "SIGINT" else 143
    return 0


if __name__ == "__main__":
    sys.exit(main())

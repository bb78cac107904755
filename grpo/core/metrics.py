"""One logger for metrics: a JSONL line per step, a console line per logging step, and an optional back end
(`--report-to`, trl's names): `tensorboard` (the [tensorboard] extra) or `wandb` (the [wandb] extra; offline
when WANDB_MODE=offline or no API key is configured: the run is kept in RUN_DIR/wandb for `wandb sync`).

metrics.jsonl and samples.jsonl are appended and flushed line by line, so they survive a crash; a
resumed run first drops any line past its checkpoint's step (and a torn last line), so no step appears twice.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import torch
from tqdm import tqdm

from grpo.algorithm.advantages import reward_function_stats


def _truncate_after(path: Path, step: int) -> None:
    """Keep only the lines of a JSONL file whose `step` is <= step (and drop a torn last line). The kept lines
    replace the file atomically, so a disk that fills up meanwhile leaves it as it was."""
    if not path.exists():
        return
    text = path.read_text()
    lines, kept = text.splitlines(), []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash or a full disk
        if record.get("step", 0) <= step:
            kept.append(line)
    if not text or (kept == lines and text.endswith("\n")):
        return  # nothing to drop
    rewritten = path.with_name(path.name + ".tmp")
    try:
        rewritten.write_text("".join(line + "\n" for line in kept))
        os.replace(rewritten, path)
    finally:
        rewritten.unlink(missing_ok=True)  # left only by a failed write


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    return value


class _NoBackend:
    def add_scalars(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise RuntimeError("--report-to tensorboard needs `pip install tensorboard`") from error
        self.writer = SummaryWriter(str(log_dir))

    def add_scalars(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config: dict | None, resume_step: int | None):
        import os

        try:
            import wandb
        except ImportError as error:  # pragma: no cover - depends on the environment
            raise RuntimeError("--report-to wandb needs `pip install wandb` (the [wandb] extra)") from error
        # Without credentials, log offline instead of stopping to ask for a login.
        logged_in = os.environ.get("WANDB_API_KEY") or _wandb_logged_in()
        mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
        run_id_file = run_dir / "wandb_run_id"
        run_id = run_id_file.read_text().strip() if resume_step is not None and run_id_file.exists() else None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo"), dir=str(run_dir), config=config,
                              mode=mode, id=run_id, resume="allow" if run_id else None, name=run_dir.name)
        run_id_file.write_text(self.run.id)

    def add_scalars(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_logged_in() -> bool:
    from pathlib import Path as _Path

    return (_Path.home() / ".netrc").exists() and "api.wandb.ai" in (_Path.home() / ".netrc").read_text()




class MetricsLogger:
    """Writes <run>/metrics.jsonl and <run>/samples.jsonl; `resume_step` drops lines a crash left past it."""

    CONSOLE_KEYS = ("reward", "reward_std", "kl", "loss", "grad_norm", "completions/mean_length", "entropy",
                    "step_time")

    def __init__(self, run_dir: str | Path, report_to: str = "none", resume_step: int | None = None,
                 config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        if resume_step is not None:
            _truncate_after(self.metrics_path, resume_step)
            _truncate_after(self.samples_path, resume_step)
        self._metrics = self.metrics_path.open("a", encoding="utf-8")
        self._samples = self.samples_path.open("a", encoding="utf-8")
        if report_to == "tensorboard":
            self.backend = _TensorBoard(self.run_dir / "tensorboard")
        elif report_to == "wandb":
            self.backend = _WandB(self.run_dir, config, resume_step)
        else:
            self.backend = _NoBackend()

    def log(self, step: int, metrics: dict, console: bool = True) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        self.backend.add_scalars(step, metrics)
        if console:
            keys = [key for key in self.CONSOLE_KEYS if isinstance(metrics.get(key), (int, float))]
            tqdm.write(f"step {step}: " + " ".join(f"{key}={metrics[key]:.4g}" for key in keys))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        for sample in samples:
            self._samples.write(json.dumps({"step": step, **sample}) + "\n")
        self._samples.flush()

    def close(self) -> None:
        for handle in (self._metrics, self._samples):
            try:
                handle.close()  # closed even when this raises
            except OSError as error:  # the unwritten rest of a line a full disk refused: log() raised it already
                if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        self.backend.close()


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def completion_records(prompts: list, texts: list[str], rewards_per_func, names: list[str],
                       advantages: torch.Tensor | None, loss_mask: torch.Tensor,
                       whole_prompts: bool = False) -> list[dict]:
    """A step's completions as records: the prompt (its last message's text; `whole_prompts`: as given, chat
    messages or text), the completion, its rewards (None where a reward function could not score) and its advantage
    (`advantages`: (N, 1), or (N, T) per token, averaged over the completion's tokens of `loss_mask` (N, T))."""
    if advantages is not None and advantages.shape[1] > 1:
        mask = loss_mask[:, : advantages.shape[1]].to(advantages)  # (N, T)
        advantages = (advantages * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    advantages = None if advantages is None else advantages[:, 0].tolist()
    records = []
    for row in range(len(texts)):
        prompt = prompts[row] if whole_prompts else (
            prompts[row][-1]["content"] if isinstance(prompts[row], list) else str(prompts[row]))
        rewards = {name: (None if math.isnan(value) else value)
                   for name, value in zip(names, rewards_per_func[row].tolist(), strict=True)}
        records.append({"prompt": prompt, "completion": texts[row], "rewards": rewards,
                        "advantage": None if advantages is None else advantages[row]})
    return records


def tool_metrics(world, rollout, device) -> dict:
    """trl's tools/call_frequency (calls per completion) and tools/failure_frequency (failed / calls), and the
    assistant turns per completion as trl's asynchronous trainer names them (rollout/turns_mean, rollout/turns_max),
    of a rollout with tool calls."""
    counts = world.gather_rows(rollout.tool_calls.float().to(device))  # (N_all, 3) calls, failed, turns
    calls, failed, turns = counts.sum(0).tolist()
    return {"tools/call_frequency": calls / counts.shape[0],
            "tools/failure_frequency": failed / calls if calls else 0.0,
            "rollout/turns_mean": turns / counts.shape[0], "rollout/turns_max": counts[:, 2].max().item()}


# trl's metric name -> the LossStats field it averages (over the step's tokens, or rows; LossStats.weights)
LOSS_STAT_METRICS = {"entropy": "entropy", "clip_ratio/low_mean": "clip_low", "clip_ratio/high_mean": "clip_high",
                     "clip_ratio/region_mean": "clip_region", "cispo_clip_ratio": "cispo_clip",
                     "vespo/phi_seq_mean": "vespo_phi", "policy_loss": "policy_loss", "kl": "kl"}


def sampling_metrics(world, mismatch: dict) -> dict:
    """The behaviour / old mismatch over every rank's tokens (grpo.algorithm.off_policy.mismatch_statistics' sums),
    under trl's names. trl averages each rank's mean; ours is the mean over all tokens, as one process computes it."""
    total = {key: world.sum(mismatch[key].item()) for key in ("diff_sum", "tokens", "kl_sum", "w_sum", "w_count")}
    largest = {key: -world.max(-mismatch[key].item()) if key == "w_min" else world.max(mismatch[key].item())
               for key in ("diff_max", "w_min", "w_max")}
    if not total["w_count"]:  # no loss token on any rank: nothing was weighted
        largest["w_min"] = largest["w_max"] = 1.0
    tokens, count = max(total["tokens"], 1.0), max(total["w_count"], 1.0)
    return {"sampling/sampling_logp_difference/mean": total["diff_sum"] / tokens,
            "sampling/sampling_logp_difference/max": largest["diff_max"],
            "sampling/importance_sampling_ratio/min": largest["w_min"],
            "sampling/importance_sampling_ratio/mean": total["w_sum"] / count,
            "sampling/importance_sampling_ratio/max": largest["w_max"],
            "sampling/mismatch_kl": total["kl_sum"] / tokens}


def loss_stat_mean(world, stats: list, name: str, average: str) -> float | None:
    """A LossStats field over the step: weighted by the tokens (or rows) each micro-batch's value is over, on every
    rank (`average` "step"); or each micro-batch's such mean over the ranks, then the mean of those ("micro_batch").
    None when no micro-batch has it."""
    pairs = [(getattr(s, name), s.weights()[name]) for s in stats if getattr(s, name) is not None]
    if average == "step":
        count = world.sum(sum(weight for _, weight in pairs))
        return world.sum(sum(value * weight for value, weight in pairs)) / count if count > 0 else None
    if not pairs:
        return None
    sums = world.all_sum(torch.tensor([[value * weight, weight] for value, weight in pairs], dtype=torch.float64,
                                      device=world.device))  # (M, 2) each micro-batch's over every rank
    return (sums[:, 0] / sums[:, 1].clamp(min=1.0)).mean().item()


def loss_stat_extreme(world, stats: list, name: str, extreme, average: str) -> float | None:
    """clip_low_min / clip_high_max over the step: `extreme` (min or max) over every micro-batch and rank
    ("step"), or over the ranks per micro-batch, then the mean of those ("micro_batch", trl's). A micro-batch
    without the statistic on any rank counts as none."""
    sign, missing = (-1.0 if extreme is min else 1.0), -float("inf")  # max over ranks of sign * value
    local = [missing if s_value is None else sign * s_value for s_value in (getattr(s, name) for s in stats)]
    if average == "step":
        largest = world.max(max(local, default=missing))
        return None if largest == missing else sign * largest
    values = [value for value in map(world.max, local) if value != missing]  # every rank in each reduction
    return sum(sign * value for value in values) / len(values) if values else None


def loss_stats_metrics(world, stats: list, average: str) -> dict:
    """trl's metrics of micro-batches' LossStats: LOSS_STAT_METRICS averaged by loss_stat_mean, and the clip ratios'
    extremes (clip_ratio/low_min, clip_ratio/high_max) by loss_stat_extreme."""
    metrics = {metric: loss_stat_mean(world, stats, name, average) for metric, name in LOSS_STAT_METRICS.items()}
    metrics["clip_ratio/low_min"] = loss_stat_extreme(world, stats, "clip_low_min", min, average)
    metrics["clip_ratio/high_max"] = loss_stat_extreme(world, stats, "clip_high_max", max, average)
    return metrics


PER_UPDATE = "per_update"  # a step's metrics: the list of its updates' own, when it has several (never logged)
ROW_ADVANTAGES = "advantages"  # Trainer.train_on_rollout's: this rank's (N, 1) or (N, T) advantages (train_step's)


def update_metrics(world, update, num_micro: int, average: str) -> list[dict]:
    """Each optimizer update's loss, grad_norm, learning_rate (and entropy_coef) and the loss statistics of its
    micro-batches (`num_micro` each), averaged as step_metrics does; for a step of several updates."""
    entries = []
    for index, (loss, grad_norm, rate) in enumerate(zip(update.step_losses, update.grad_norms,
                                                        update.learning_rates, strict=True)):
        stats = update.micro_batch_stats[index * num_micro : (index + 1) * num_micro]
        entry = {"loss": loss, "grad_norm": grad_norm, "learning_rate": rate,
                 "entropy_coef": update.entropy_coefs[index] if update.entropy_coefs else None}
        entry.update(loss_stats_metrics(world, stats, average))
        entries.append({key: value for key, value in entry.items() if value is not None})
    return entries


def step_metrics(world, rollout, loss_mask, all_rewards, all_advantages, update, reward_names: list[str],
                 learning_rate: float, skipped_updates: int, tokens_seen: int, average: str = "step") -> dict:
    """A step's logged metrics, with trl's names, over every rank: rewards, advantages, the loss statistics of
    the micro-batches (`average`: "step", the mean over the step's tokens or rows, the same at any micro-batch size
    and world size; "micro_batch", each micro-batch's mean over every rank, then the mean of those, as trl), lengths
    (the model's own tokens: tool results not counted, as trl), tool calls, and num_tokens: `tokens_seen`, the
    prompt and completion tokens of every step so far, as trl. `update`: grpo.core.update.UpdateResult, its losses
    and statistics. A statistic no micro-batch has (kl with beta = 0, cispo's with another loss type) is left
    out."""
    device = loss_mask.device
    raw_lengths = world.gather_rows(rollout.loss_mask.sum(-1).float().to(device))
    truncated = world.gather_rows(rollout.truncated.float().to(device)).bool()
    terminated = raw_lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1, device=device)
    metrics = {
        **reward_function_stats(all_rewards, reward_names),
        "advantages/abs_mean": all_advantages.abs().mean().item(),
        "loss": sum(update.step_losses) / len(update.step_losses),
        "grad_norm": update.grad_norms[-1],
        "learning_rate": learning_rate,
        "entropy_coef": update.entropy_coefs[-1] if update.entropy_coefs else None,
        "completions/mean_length": raw_lengths.mean().item(),
        "completions/min_length": raw_lengths.min().item(),
        "completions/max_length": raw_lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "completions/min_terminated_length": terminated.min().item(),
        "completions/max_terminated_length": terminated.max().item(),
        "num_tokens": tokens_seen,
        "skipped_updates": skipped_updates,
        **(tool_metrics(world, rollout, device) if rollout.tool_calls is not None else {}),
        **loss_stats_metrics(world, update.micro_batch_stats, average),
    }
    return {key: value for key, value in metrics.items() if value is not None}  # what this loss type logs

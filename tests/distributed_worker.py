"""One process of the distributed tests (tests/test_distributed.py): torchrun starts 1, 2 or 4 of these.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed_worker.py OUT SCENARIO [JSON overrides]

Each rank trains the same small run and writes what it saw to OUT/rank-<r>.pt: per step its prompt indices,
each prompt's completions, the gathered advantages, the metrics, the averaged gradient of the first update
and the reference log-probs; at the end the full weights and whether the reference changed.
With generation_backend "vllm" each rank with an engine also records the engine's log-probs of FIXED_SEQUENCE
before and after training (`engine_start`, `engine_end`).
Scenarios: `engine_raise` (the engine fails in step 2), `engine_kill` (the processes of a generation rank's
engine are killed in step 2), `train` (the run), `kill` (rank 1 kills itself mid-step 2), `raise` (rank 1 raises in step 2);
with --max-staleness (generation processes, the last ranks): `gen_kill` / `gen_raise` (the generation process
kills itself / raises while sampling step 2). With --vllm-mode server, `record_each_push` records the server's and
the policy's log-probs of FIXED_SEQUENCE at the start and after each update (`pushes`), and `kill_server_at_step`
kills the process group `server_pid` before that step samples. JSON overrides are GRPOConfig fields, plus `until`
(train(until_step=...)). Under --max-staleness the training ranks receive their rows from the generation
processes, so their records hold no prompt indices or completions.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

torch.set_num_threads(1)

from grpo.config import GRPOConfig  # noqa: E402
from grpo.parallel.distributed import unwrap  # noqa: E402
from grpo.parallel.distributed import full_tensor as _full  # noqa: E402
from grpo.core.trainer import Trainer  # noqa: E402
from tests.conftest import batch_indices  # noqa: E402

# AdamW's epsilon 1e-6 (as tests/test_trl_parity.py and test_trainer's kernel tests), not the default 1e-8: a step
# moves a weight by lr m / (sqrt(v) + eps), whose slope in the gradient reaches lr / eps where the gradient is within
# rounding of 0. The ranks sum each gradient in another order (~2.4e-7 of its largest entry apart); at 1e-8
# (lr / eps = 1e5) the environments' run moved layer 1's v_proj.weight entry whose first gradient is -2.6e-9 by
# 8.5e-3 lr apart, and step 2's gradient, taken at those weights, came 1.5e-5 of its scale apart (o_proj.weight),
# where from the same weights it is 2.5e-7 apart. At 1e-6 that amplification is 100x smaller.
BASE = dict(model="tiny", dataset="synthetic:64", prompts_per_step=4, num_generations=4, micro_batch_size=4,
            max_prompt_length=128, max_completion_length=8, learning_rate=1e-3, adam_epsilon=1e-6, reward=["tags"],
            device="cpu", precision="fp32", save_steps=0, log_completions_steps=0, logging_steps=100,
            warmup_ratio=0.0, beta=0.04, max_steps=3, distributed_timeout=30.0)


def completion_length(completions, **kwargs) -> list[float]:
    """A reward with a signal on any model (`tests.distributed_worker:completion_length`): the completion's length in
    characters / 100 (the server tests' SmolLM2 writes no answer within their 16 tokens)."""
    return [len(completion[0]["content"]) / 100 for completion in completions]


def long_completion(completions, **kwargs) -> list[float]:
    """1 for a completion over LONG characters: some of the tiny model's groups tie and others do not, so dynamic
    sampling drops groups and samples more rounds (`tests.distributed_worker:long_completion`)."""
    return [float(len(completion[0]["content"]) > LONG) for completion in completions]


LONG = 20


@torch.no_grad()
def penalized_logprobs(model, rollout, penalty: float, temperature: float) -> torch.Tensor:
    """(N, T) the rollout's completion tokens' log-probs under `model` with the repetition penalty, recomputed from one
    full forward: each position's logits penalized for the row's tokens so far, then divided by the temperature."""
    from grpo.algorithm.logprobs import position_ids_from_mask
    from grpo.algorithm.sampler import penalize_repetition, seen_tokens

    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # (N, P + T)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits.float()
    width, rows = rollout.prompt_ids.shape[1], torch.arange(ids.shape[0])
    seen = seen_tokens(rollout.prompt_ids, rollout.prompt_mask, logits.shape[-1])  # (N, V)
    out = torch.zeros(rollout.completion_ids.shape)
    for t in range(rollout.completion_ids.shape[1]):
        tokens = rollout.completion_ids[:, t]
        step = penalize_repetition(logits[:, width + t - 1], seen, penalty) / temperature
        out[:, t] = torch.log_softmax(step, -1)[rows, tokens]
        seen[rows, tokens] = True
    return out * rollout.completion_mask


def engine_logps(trainer, token_ids: list[int]):
    """A vLLM backend's engine: its log-probs of `token_ids` (each token after the first), after loading the
    policy's weights if an update made them stale; None for other backends (tests/test_vllm.py)."""
    generation = trainer.generation
    if hasattr(generation, "server"):  # --vllm-mode server: the same question over HTTP
        if generation.stale:
            generation.sync_weights()
        choice = generation.server.call("v1/completions", {"model": generation.served_model, "prompt": token_ids,
                                                           "max_tokens": 1, "temperature": 0.0,
                                                           "prompt_logprobs": 0})["choices"][0]
        return torch.tensor([entry[str(token)]["logprob"]
                             for entry, token in zip(choice["prompt_logprobs"][1:], token_ids[1:])])
    if not hasattr(generation, "llm"):
        return None
    from vllm import SamplingParams

    if generation.stale:
        generation.sync_weights()
    output = generation.llm.generate([{"prompt_token_ids": token_ids}], SamplingParams(
        max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])])


@torch.no_grad()
def policy_logps(trainer, token_ids: list[int]) -> torch.Tensor:
    """The trained policy's fp32 log-probs of `token_ids` (each token after the first), as the update computes
    them (every training rank calls it: FSDP2 gathers)."""
    ids = torch.tensor([token_ids])
    logits = trainer.models.policy_call(lambda model: model(input_ids=ids).logits)[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


FIXED_SEQUENCE = [3, 40, 41, 42, 7, 99, 120, 5, 60, 61, 200, 17]  # token ids the engine scores (tiny vocabulary)


def full_params(trainer) -> dict:
    return {name: _full(p.detach()).clone() for name, p in unwrap(trainer.models.policy_call).named_parameters()}


def main():
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    until = overrides.pop("until", None)  # stop (and save) after this step: a run in two pieces
    each_push = overrides.pop("record_each_push", False)  # --vllm-mode server: the server's log-probs after each push
    kill_server_at = overrides.pop("kill_server_at_step", None)  # ... and the server killed before this step
    server_pid = overrides.pop("server_pid", None)
    config = GRPOConfig(**{**BASE, "output_dir": str(out / "run"), **overrides})
    trainer = Trainer(config)
    rank = trainer.processes.global_rank
    models = trainer.models
    record = {"steps": [], "world_size": trainer.world.size, "mode": models.distributed}
    ref_before = None if models.reference is None else full_params_of(models.reference_call)

    collect, update, step_fn = trainer.collect_rollout, trainer.update, trainer.optimizer.step
    current = {}

    def collecting(step):
        if kill_server_at is not None and step + 1 == kill_server_at:
            os.killpg(server_pid, signal.SIGKILL)
        rollout, prompts, texts, metrics = collect(step)
        size = config.prompts_per_generation // trainer.world.size  # this rank's slice of the step's prompts
        indices = batch_indices(trainer, step)[rank * size : (rank + 1) * size]
        completions = {}
        for position, index in enumerate(indices):
            rows = range(position * config.num_generations, (position + 1) * config.num_generations)
            completions[index] = [rollout.completion_ids[r][rollout.completion_mask[r].bool()].tolist() for r in rows]
        current.update(indices=indices, completions=completions, grads=None)
        if step == 0 and config.repetition_penalty != 1.0 and rollout.sampler_logprobs is not None:
            current.update(sampled_logprobs=rollout.sampler_logprobs * rollout.completion_mask,
                           penalized=penalized_logprobs(trainer.policy, rollout, config.repetition_penalty,
                                                        config.temperature),
                           unpenalized=penalized_logprobs(trainer.policy, rollout, 1.0, config.temperature))
        if scenario == "kill" and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "raise" and rank == 1 and step == 1:
            raise RuntimeError("a deliberate failure on rank 1")
        return rollout, prompts, texts, metrics

    def updating(rollout):  # the public call with every intermediate value
        last = update(rollout)
        if each_push:  # the update made the server stale: push now and ask it
            record["pushes"].append((engine_logps(trainer, FIXED_SEQUENCE), policy_logps(trainer, FIXED_SEQUENCE)))
        record["steps"].append({**current, "metrics": last.metrics,
                                "advantages": trainer.world.gather_rows(last.advantages.cpu()),
                                "ref_logps": None if last.ref_logps is None else last.ref_logps.cpu()})
        return last

    def stepping():
        if current.get("grads") is None:  # the first update of the step: its averaged full gradient
            current["grads"] = {name: _full(p.grad).clone() for name, p in
                                unwrap(models.policy_call).named_parameters() if p.grad is not None}
        return step_fn()

    def generating(step, *backend_and_world):  # a generation process samples for the training ranks
        if step == 1 and scenario == "gen_kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 1 and scenario == "engine_kill":  # the vLLM engine's own processes die under the generation rank
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
        if step == 1 and scenario == "gen_raise":
            raise RuntimeError("a deliberate failure in the generation process")
        return collect(step, *backend_and_world)

    if scenario == "engine_raise" and hasattr(trainer.generation, "llm"):  # the engine fails in step 2
        engine_generate = trainer.generation.llm.generate

        def failing(*args, **kwargs):
            if trainer.step == 1:
                raise RuntimeError("a deliberate engine failure")
            return engine_generate(*args, **kwargs)

        trainer.generation.llm.generate = failing
    if config.max_staleness is None:
        trainer.collect_rollout = collecting
    elif trainer.processes.generating:
        trainer.collect_rollout = generating
    trainer.update, trainer.optimizer.step = updating, stepping
    engine_start = None if trainer.processes.generating else engine_logps(trainer, FIXED_SEQUENCE)
    record["pushes"] = [(engine_start, policy_logps(trainer, FIXED_SEQUENCE))] if each_push else []
    result = trainer.train(until_step=until)
    record.update(result=result, params=full_params(trainer), generating=trainer.processes.generating,
                  engine_start=engine_start, engine_end=None if trainer.processes.generating else engine_logps(trainer, FIXED_SEQUENCE),
                  policy_logps=None if trainer.processes.generating else policy_logps(trainer, FIXED_SEQUENCE))
    if ref_before is not None:
        after = full_params_of(models.reference_call)
        record["ref_unchanged"] = all(torch.equal(ref_before[k], after[k]) for k in ref_before)
    torch.save(record, out / f"rank-{rank}.pt")
    trainer.close()  # as train.py does: the engine and the process group are gone before the interpreter exits
    assert not torch.distributed.is_initialized()


def full_params_of(call) -> dict:
    return {name: _full(p.detach()).clone() for name, p in unwrap(call).named_parameters()}


if __name__ == "__main__":
    main()

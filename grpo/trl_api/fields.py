"""Every field of trl 1.16's GRPOConfig (its own and the transformers TrainingArguments it inherits), with trl's
default and what this engine does with it:

    honoured  the value is used (`ours` names our setting; `note` says where the meaning differs from trl's)
    left      accepted at any value and without effect here, for the reason given; a value other than trl's
              default is listed once when the run starts (never silently dropped)
    refused   only trl's default (or a value in `accepted`) is accepted; any other is one `error:` line with
              the reason

tests/test_trl_api.py walks `dataclasses.fields(trl.GRPOConfig)` and fails on a field missing here or on a default
that differs from trl's, so that a field a later trl adds is caught. docs/trl.md is this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """One trl field: its trl default, what happens to it here, our setting it becomes, and why."""

    default: object
    kind: str  # "honoured" | "left" | "refused"
    ours: str = ""
    note: str = ""
    accepted: tuple = ()


def same(default, ours: str = "", note: str = "") -> Field:
    return Field(default, "honoured", ours, note)


def left(default, note: str) -> Field:
    return Field(default, "left", "", note)


def refused(default, note: str, *accepted) -> Field:
    return Field(default, "refused", "", note, accepted)


NO_HUB = "no model hub is reached from here: save_model() writes output_dir, push it yourself"
NO_DATALOADER = "rows are held in memory and batched by the loop, without a torch DataLoader"
NO_DEEPSPEED = "no DeepSpeed here: one process, DDP or FSDP2 (trl's fsdp and ddp fields)"
BATCH = "trl_api.batch.translate: trl's per-device completions become prompts per step and micro-batches"
TRL_EVAL = ("GRPOTrainer evaluates as trl (trl_api.evaluation: sampled completions, the loss and metrics without "
            "an update); train.py --config evaluates greedily, scored by the rewards; neither reads this option of "
            "transformers' evaluation loop")

FIELDS: dict[str, Field] = {
    # ---- transformers.TrainingArguments, in its order
    "output_dir": same(None, "output_dir", "None: 'trainer_output', as transformers"),
    "per_device_train_batch_size": same(8, "micro_batch_size", BATCH),
    "num_train_epochs": same(3.0, "epochs", "used when max_steps <= 0, as transformers"),
    "max_steps": same(-1, "max_steps", "trl counts optimizer steps; ours rollouts of num_iterations x k updates "
                                       "each (" + BATCH + ")"),
    "learning_rate": same(1e-6, "learning_rate"),
    "lr_scheduler_type": same("linear", "lr_scheduler_type", "linear, cosine and constant; the others are refused"),
    "lr_scheduler_kwargs": refused(None, "the schedules here take no extra arguments", {}),
    "warmup_steps": same(0, "warmup_steps / warmup_ratio", "a value >= 1 counts optimizer steps, < 1 is a ratio "
                                                          "of them, as transformers 5"),
    "optim": same("adamw_torch_fused", "optim", "adamw_torch(_fused) -> adamw, adamw_8bit / adamw_bnb_8bit -> "
                                                "adamw_8bit (bitsandbytes); the others are refused"),
    "optim_args": refused(None, "the optimizers here take no extra arguments"),
    "weight_decay": same(0.0, "weight_decay"),
    "adam_beta1": same(0.9, "adam_beta1"),
    "adam_beta2": same(0.999, "adam_beta2"),
    "adam_epsilon": same(1e-8, "adam_epsilon"),
    "optim_target_modules": refused(None, "only GaLore-style optimizers read it, and none is built here"),
    "gradient_accumulation_steps": same(1, "prompts_per_step", BATCH),
    "average_tokens_across_devices": left(True, "GRPO normalises the loss by its own token and row counts (as "
                                                "trl's GRPOTrainer, which ignores it too)"),
    "max_grad_norm": same(1.0, "max_grad_norm"),
    "label_smoothing_factor": refused(0.0, "GRPO's loss has no labels to smooth"),
    "bf16": same(None, "precision", "None: not fp16, as trl; True: bf16 autocast with fp32 master weights"),
    "fp16": refused(False, "fp16 is not built here: bf16 (bf16=True) keeps fp32's range"),
    "bf16_full_eval": refused(False, "evaluation runs in the training precision"),
    "fp16_full_eval": refused(False, "evaluation runs in the training precision"),
    "tf32": same(None, "", "sets torch's TF32 matmul flags on CUDA; no effect on CPU"),
    "gradient_checkpointing": same(True, "gradient_checkpointing"),
    "gradient_checkpointing_kwargs": refused(None, "checkpointing here is non-reentrant, with no other option",
                                             {}, {"use_reentrant": False}),
    "torch_compile": refused(False, "compiled kernels are chosen by our kernels setting (--kernels auto)"),
    "torch_compile_backend": refused(None, "compiled kernels are chosen by our kernels setting (--kernels auto)"),
    "torch_compile_mode": refused(None, "compiled kernels are chosen by our kernels setting (--kernels auto)"),
    "use_liger_kernel": refused(False, "Liger is not used here; the fused log-prob kernel is grpo/kernels"),
    "liger_kernel_config": refused(None, "Liger is not used here; the fused log-prob kernel is grpo/kernels"),
    "use_cache": left(False, "training forward passes take no KV cache; sampling keeps its own"),
    "neftune_noise_alpha": refused(None, "NEFTune is for supervised fine-tuning"),
    "torch_empty_cache_steps": left(None, "the loop does not empty the CUDA cache on a schedule"),
    "auto_find_batch_size": refused(False, "trl refuses it for GRPO too"),
    "logging_strategy": same("steps", "logging_steps", "'no' logs to metrics.jsonl only; 'epoch' is refused"),
    "logging_steps": same(10, "logging_steps", "optimizer steps between state.log_history entries, as trl (a "
                                               "ratio < 1 of max_steps is converted); metrics.jsonl gets every "
                                               "step"),
    "logging_first_step": same(False, "", "an entry in state.log_history after step 1 too, as transformers"),
    "log_on_each_node": left(True, "rank 0 logs"),
    "logging_nan_inf_filter": left(True, "a non-finite loss skips its update here (max_bad_steps), nothing is "
                                         "averaged over"),
    "include_num_input_tokens_seen": refused("no", "the token counts are logged as num_tokens", False),
    "log_level": left("passive", "the 'grpo' logger logs at INFO"),
    "log_level_replica": left("warning", "only rank 0 logs"),
    "disable_tqdm": left(None, "the progress bar shows on rank 0"),
    "report_to": same("none", "report_to", "none, tensorboard or wandb (one of them)"),
    "run_name": left(None, "runs are named by output_dir"),
    "project": left("huggingface", "trackio is not built here"),
    "trackio_space_id": left(None, "trackio is not built here"),
    "trackio_bucket_id": left(None, "trackio is not built here"),
    "trackio_static_space_id": left(None, "trackio is not built here"),
    "eval_strategy": same("no", "eval_steps", "'steps' evaluates every eval_steps optimizer steps (GRPOTrainer: as "
                                              "trl; train.py --config: greedily); 'epoch' is refused"),
    "eval_steps": same(None, "eval_steps", "None: logging_steps, as transformers"),
    "eval_delay": refused(0, "evaluation starts at eval_steps", 0.0),
    "per_device_eval_batch_size": same(8, "eval_batch_size", "GRPOTrainer: completions per eval batch and device, as "
                                                             "trl; train.py --config: prompts decoded together"),
    "prediction_loss_only": left(False, TRL_EVAL),
    "eval_on_start": refused(False, "evaluation runs every eval_steps and at the end; call evaluate() first"),
    "eval_do_concat_batches": left(True, TRL_EVAL),
    "eval_use_gather_object": left(False, TRL_EVAL),
    "eval_accumulation_steps": left(None, TRL_EVAL),
    "include_for_metrics": left([], TRL_EVAL),
    "batch_eval_metrics": left(False, TRL_EVAL),
    "save_only_model": refused(False, "a checkpoint keeps the optimizer and RNG states, so that resume is exact"),
    "save_strategy": same("steps", "save_steps", "'no' saves only at the end (so that the run can resume); "
                                                "'epoch' for a run of one epoch (its end); otherwise refused, and "
                                                "'best'"),
    "save_steps": same(500, "save_steps", "whole steps (a ratio < 1 of max_steps is converted)"),
    "save_on_each_node": left(False, "rank 0 writes the checkpoint"),
    "save_total_limit": same(None, "save_total_limit", "None: keep all"),
    "enable_jit_checkpoint": refused(False, "checkpoints are written at save_steps and on SIGTERM/SIGINT"),
    "push_to_hub": refused(False, NO_HUB),
    "hub_token": left(None, NO_HUB),
    "hub_private_repo": left(None, NO_HUB),
    "hub_model_id": left(None, NO_HUB),
    "hub_strategy": left("every_save", NO_HUB),
    "hub_always_push": left(False, NO_HUB),
    "hub_revision": left(None, NO_HUB),
    "load_best_model_at_end": refused(False, "the run keeps its last weights; evaluation picks no checkpoint"),
    "metric_for_best_model": left(None, "no best model is chosen (load_best_model_at_end)"),
    "greater_is_better": left(None, "no best model is chosen (load_best_model_at_end)"),
    "ignore_data_skip": refused(False, "resume continues the data order exactly"),
    "restore_callback_states_from_checkpoint": refused(False, "callbacks keep no state in checkpoints here"),
    "full_determinism": refused(False, "CUDA's deterministic algorithms are not switched on here; CPU runs are "
                                       "reproducible from the seed"),
    "seed": same(42, "seed"),
    "data_seed": left(None, "the prompt order follows seed, as trl's GRPOTrainer"),
    "use_cpu": same(False, "device", "True: device cpu"),
    "accelerator_config": refused(None, "accelerate is not used here"),
    "parallelism_config": refused(None, "context and sequence parallelism are not built here"),
    "dataloader_drop_last": left(False, NO_DATALOADER),
    "dataloader_num_workers": left(0, NO_DATALOADER),
    "dataloader_pin_memory": left(True, NO_DATALOADER),
    "dataloader_persistent_workers": left(False, NO_DATALOADER),
    "dataloader_prefetch_factor": left(None, NO_DATALOADER),
    "dataloader_multiprocessing_context": left(None, NO_DATALOADER),
    "dataloader_in_order": left(True, NO_DATALOADER),
    "remove_unused_columns": same(False, "", "True: the reward functions get only the prompt column, as trl"),
    "label_names": left(None, "GRPO has no labels"),
    "train_sampling_strategy": left("random", "GRPO samples prompts in groups (shuffle_dataset), as trl"),
    "length_column_name": left("length", "GRPO does not group by length"),
    "ddp_find_unused_parameters": left(None, "our DDP wrapper finds no unused parameters in a causal LM"),
    "ddp_bucket_cap_mb": left(None, "DDP's default buckets"),
    "ddp_broadcast_buffers": left(None, "DDP's default"),
    "ddp_static_graph": left(None, "DDP's default"),
    "ddp_backend": left(None, "nccl on CUDA, gloo on CPU"),
    "ddp_timeout": same(1800, "distributed_timeout"),
    "fsdp": same(None, "distributed", "'full_shard' (with 'auto_wrap'): FSDP2; 'offload': fsdp_cpu_offload; "
                                      "other modes are refused"),
    "fsdp_config": refused(None, "FSDP2 here wraps each decoder layer; fsdp='... offload' moves it to CPU"),
    "deepspeed": refused(None, NO_DEEPSPEED),
    "debug": refused("", "transformers' debug options are not built here"),
    "skip_memory_metrics": left(True, "memory is logged as memory/* metrics on CUDA"),
    "do_train": left(False, "read by scripts, not by the trainer (as transformers)"),
    "do_eval": left(False, "read by scripts, not by the trainer (as transformers)"),
    "do_predict": left(False, "read by scripts, not by the trainer (as transformers)"),
    "resume_from_checkpoint": left(None, "read by scripts, which pass it to train(resume_from_checkpoint=...); "
                                         "the trainer does not read it (as transformers)"),
    "local_rank": left(-1, "torchrun's RANK / LOCAL_RANK are read"),
    # ---- trl.GRPOConfig's own, in its order
    "model_init_kwargs": same(None, "precision", "dtype (torch_dtype): float32 -> fp32, bfloat16 -> bf16-pure; "
                                                 "trust_remote_code; attn_implementation is listed as left (sdpa "
                                                 "here, the kernels choose flash or flex attention); other keys "
                                                 "refused"),
    "trust_remote_code": same(False, "trust_remote_code"),
    "router_aux_loss_coef": refused(None, "mixture-of-experts auxiliary losses are not built here"),
    "disable_dropout": same(False, "disable_dropout"),
    "cast_lm_head_to_fp32": same(False, "cast_lm_head_to_fp32"),
    "num_generations": same(8, "num_generations"),
    "num_generations_eval": same(None, "", "GRPOTrainer: completions per prompt in evaluation (None: "
                                          "num_generations), as trl; train.py --config evaluates greedily"),
    "max_completion_length": same(512, "max_completion_length"),
    "ds3_gather_for_generation": left(True, NO_DEEPSPEED),
    "shuffle_dataset": same(True, "shuffle_dataset", "in trl's order (trl_api.rollouts.TrlOrder)"),
    "pad_to_multiple_of": same("auto", "pad_to_multiple_of", "an int pads each micro-batch's sequences (prompt and "
                                                            "completion together) on the left to a multiple of it; "
                                                            "'auto' and None: no padding (auto pads on Neuron only)"),
    "generation_batch_size": same(None, "steps_per_generation", BATCH),
    "steps_per_generation": same(None, "steps_per_generation", BATCH),
    "temperature": same(1.0, "temperature"),
    "top_p": same(1.0, "top_p"),
    "top_k": same(0, "top_k"),
    "min_p": same(None, "min_p", "None: 0.0 (off)"),
    "generation_kwargs": same(None, "", "the keys temperature, top_p, top_k, min_p and repetition_penalty, which "
                                        "override those fields, as trl; other keys are refused"),
    "chat_template_kwargs": same(None, "chat_template_kwargs"),
    "repetition_penalty": same(1.0, "repetition_penalty", "the sampler's log-probs are the penalized distribution's"),
    "cache_implementation": same(None, "cache_implementation", "set: completions are sampled by transformers' "
                                                               "generate with that cache, as trl (refused with "
                                                               "use_vllm); None: our sampler"),
    "use_vllm": same(False, "use_vllm"),
    "vllm_mode": same("colocate", "vllm_mode", "server: vLLM's own server, its weights pushed over the engine it "
                                               "was started with: NCCL (trl's) or CUDA IPC on GPUs, grpo_gloo on a "
                                               "CPU (docs/vllm.md)"),
    "vllm_model_impl": same("vllm", "vllm_model_impl"),
    "vllm_enable_sleep_mode": same(False, "vllm_enable_sleep_mode", "sleep level 1 (weights to CPU); trl level 2"),
    "vllm_structured_outputs_regex": same(None, "vllm_structured_outputs_regex", "vLLM's guided decoding of the "
                                                                               "training completions"),
    "vllm_server_base_url": same(None, "vllm_server_base_url"),
    "vllm_server_host": same("0.0.0.0", "vllm_server_host"),
    "vllm_server_port": same(8000, "vllm_server_port"),
    "vllm_server_timeout": same(240.0, "vllm_server_timeout"),
    "vllm_group_port": same(51216, "vllm_group_port"),
    "vllm_gpu_memory_utilization": same(0.3, "vllm_gpu_memory_utilization"),
    "vllm_max_model_length": same(None, "vllm_max_model_length"),
    "vllm_tensor_parallel_size": same(1, "vllm_tensor_parallel_size"),
    "beta": same(0.0, "beta"),
    "num_iterations": same(1, "num_iterations"),
    "epsilon": same(0.2, "epsilon"),
    "delta": same(None, "delta"),
    "epsilon_high": same(None, "epsilon_high"),
    "sapo_temperature_neg": same(1.05, "sapo_temperature_neg"),
    "sapo_temperature_pos": same(1.0, "sapo_temperature_pos"),
    "vespo_k_pos": same(2.0, "vespo_k_pos"),
    "vespo_lambda_pos": same(3.0, "vespo_lambda_pos"),
    "vespo_k_neg": same(3.0, "vespo_k_neg"),
    "vespo_lambda_neg": same(2.0, "vespo_lambda_neg"),
    "importance_sampling_level": same("token", "importance_sampling_level"),
    "reward_weights": same(None, "reward", "each reward function's weight"),
    "multi_objective_aggregation": same("sum_then_normalize", "multi_objective_aggregation"),
    "scale_rewards": same("group", "scale_rewards", "True: 'group', False: 'none', as trl"),
    "loss_type": same("dapo", "loss_type"),
    "mask_truncated_completions": same(False, "mask_truncated_completions"),
    "sync_ref_model": same(False, "sync_ref_model"),
    "ref_model_mixup_alpha": same(0.6, "ref_model_mixup_alpha"),
    "ref_model_sync_steps": same(512, "ref_model_sync_steps"),
    "top_entropy_quantile": same(1.0, "top_entropy_quantile"),
    "entropy_coef": same(0.0, "entropy_coef"),
    "use_adaptive_entropy": same(False, "use_adaptive_entropy"),
    "entropy_coef_min": same(0.0, "entropy_coef_min"),
    "entropy_coef_max": same(1.0, "entropy_coef_max"),
    "entropy_coef_delta": same(0.005, "entropy_coef_delta"),
    "entropy_target": same(0.2, "entropy_target"),
    "max_tool_calling_iterations": same(None, "max_tool_calling_iterations"),
    "vllm_importance_sampling_correction": same(True, "importance_sampling_correction",
                                                "True: on when vLLM samples (auto), as trl"),
    "vllm_importance_sampling_mode": same("sequence_mask", "importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": same(3.0, "importance_sampling_clip_max"),
    "vllm_importance_sampling_clip_min": same(None, "importance_sampling_clip_min"),
    "off_policy_mask_threshold": same(None, "off_policy_mask_threshold"),
    "use_bias_correction_kl": same(True, "use_bias_correction_kl"),
    "log_completions": same(False, "log_completions_steps", "True: every logging_steps GRPOTrainer prints the "
                                                           "step's completions and writes completions/*.parquet, as "
                                                           "trl (prompt: its last message's text); samples.jsonl "
                                                           "holds the first group"),
    "log_multimodal": left(True, "text only here"),
    "num_completions_to_print": same(None, "", "GRPOTrainer prints that many of the logged completions, drawn at "
                                               "random (all when None), as trl"),
    "log_unique_prompts": left(False, "trl drops repeated prompts from its wandb / trackio completions table; no "
                                      "completions table is sent to wandb here (the parquet files keep every "
                                      "completion, as trl's)"),
    "log_completions_hub_repo": refused(None, NO_HUB),
    "use_transformers_continuous_batching": refused(False, "our sampler (or vLLM) batches the generation"),
    "transformers_continuous_batching_config": refused(None, "our sampler (or vLLM) batches the generation"),
    "use_transformers_paged": refused(False, "our sampler (or vLLM) batches the generation"),
    "vllm_importance_sampling_cap": same(None, "importance_sampling_clip_max", "deprecated in trl: its clip_max"),
}


def field_table() -> str:
    """docs/trl.md's field table (`python -m grpo.trl_api.fields` prints it; tests/test_docs.py keeps it current)."""
    lines = ["| trl field | trl default | here | our setting | why, or how it differs |", "|---|---|---|---|---|"]
    for name, spec in FIELDS.items():
        note = spec.note.replace("|", "/")
        if spec.accepted:
            note += " (accepted: " + ", ".join(repr(value) for value in spec.accepted) + ")"
        lines.append(f"| `{name}` | `{spec.default!r}` | {spec.kind} | {spec.ours and f'`{spec.ours}`'} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(field_table())

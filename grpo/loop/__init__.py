"""The loop that composes the algorithm, and its machinery.

    trainer           the training loop: sample -> reward -> update -> log -> save (Trainer.train, train_step)
    update            one update: advantages -> ref/old log-probs -> micro-batch losses -> clip -> AdamW
    rollout           what one step trains on, the step's prompts, the generation seam, sample_rollout
    setup             what a run needs before its first step, and the one choice of --kernels
    metrics           the metrics logger and a step's metrics (trl's names)
    distributed       torchrun: collectives, DDP / FSDP2 wrappers
    dynamic_sampling  DAPO's dynamic sampling
    run_state, checkpoint   a run's state, saved atomically and resumed
    evaluation        greedy evaluation and its scorers
    tools, prompts, lora    tool calls in the rollout, chat prompts, LoRA through peft
"""

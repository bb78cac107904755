"""The trl script this project was first asked to replace (docs/trl.md), re-typed: GSM8K in the R1 layout, five
reward functions with trl's signature, trl's GRPOConfig and GRPOTrainer. Only the import line below names the engine:
`from trl import GRPOConfig, GRPOTrainer` runs the same file under trl 1.16.

    python examples/trl_seed_script.py                       # Qwen2.5-0.5B-Instruct, GSM8K from the hub, a GPU
    python examples/trl_seed_script.py --model path/to/model --data ../shared/data/gsm8k --cpu --max-steps 3

tests/test_trl_dropin.py runs it under both imports and compares trl's log_history with ours.
"""

import argparse
import re

import torch
from datasets import Dataset, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.trl_api import GRPOConfig, GRPOTrainer

SYSTEM_PROMPT = """Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>"""


def extract_answer(text: str) -> str:
    """The text between the answer tags (the whole text when there are none)."""
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def gsm8k_rows(data: str | None) -> Dataset:
    """GSM8K's training rows as chat prompts with the gold number (after '####') as `answer`."""
    source = (load_dataset("json", data_files=f"{data}/train.jsonl")["train"] if data
              else load_dataset("openai/gsm8k", "main")["train"])
    rows = [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
             "answer": row["answer"].split("####")[-1].strip().replace(",", "")} for row in source]
    return Dataset.from_list(rows)


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """2.0 when the text inside the answer tags is the gold answer."""
    return [2.0 if extract_answer(c[0]["content"]) == gold else 0.0 for c, gold in zip(completions, answer)]


def int_reward(completions, **kwargs) -> list[float]:
    """0.5 when the text inside the answer tags is a whole number."""
    return [0.5 if extract_answer(c[0]["content"]).lstrip("-").isdigit() else 0.0 for c in completions]


def strict_format_reward(completions, **kwargs) -> list[float]:
    """0.5 when the whole completion is exactly the layout, line by line."""
    pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    return [0.5 if re.match(pattern, c[0]["content"], flags=re.DOTALL) else 0.0 for c in completions]


def soft_format_reward(completions, **kwargs) -> list[float]:
    """0.5 when both tag pairs appear in order, anything between."""
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    return [0.5 if re.search(pattern, c[0]["content"], flags=re.DOTALL) else 0.0 for c in completions]


def xmlcount_reward(completions, **kwargs) -> list[float]:
    """0.125 for each of the four tags present exactly once, minus 0.001 per character after </answer>."""
    scores = []
    for completion in completions:
        text, score = completion[0]["content"], 0.0
        for tag in ("<reasoning>\n", "\n</reasoning>\n", "\n<answer>\n", "\n</answer>"):
            score += 0.125 if text.count(tag) == 1 else 0.0
        if text.count("\n</answer>") == 1:
            score -= 0.001 * len(text.split("\n</answer>")[-1])
        scores.append(score)
    return scores


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--data", default=None, help="a folder with GSM8K's train.jsonl (default: the hub's)")
    parser.add_argument("--output-dir", default="./qwen_grpo_output")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    parser.add_argument("--logging-steps", type=int, default=10, help="log every N optimizer steps")
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--max-completion-length", type=int, default=512, help="trl's default, which the article kept")
    parser.add_argument("--cpu", action="store_true", help="use_cpu, fp32 (no bf16, no TF32, AdamW without bnb)")
    options = parser.parse_args(argv)
    gpu = not options.cpu
    training_args = GRPOConfig(
        output_dir=options.output_dir, num_train_epochs=1, max_steps=options.max_steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=4, learning_rate=options.learning_rate,
        logging_steps=options.logging_steps, save_steps=500, eval_strategy="no", bf16=gpu, tf32=gpu,
        gradient_checkpointing=True, optim="adamw_8bit" if gpu else "adamw_torch",
        report_to="tensorboard" if gpu else "none", remove_unused_columns=False, use_cpu=options.cpu,
        max_completion_length=options.max_completion_length)
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.bfloat16 if gpu else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer,
        reward_funcs=[xmlcount_reward, soft_format_reward, strict_format_reward, int_reward, correctness_reward],
        args=training_args, train_dataset=gsm8k_rows(options.data))
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()

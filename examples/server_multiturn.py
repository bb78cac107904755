"""A multi-turn environment that talks to the policy only through the vLLM server's OpenAI-style endpoint
(`/v1/chat/completions`), as an agent harness does, instead of our tool loop: guess the number. The environment
thinks of a whole number from 1 to 20; the model guesses, the environment answers "Higher." or "Lower.", for up to
MAX_TURNS guesses.

    python -m grpo.generation.vllm_server --model smollm2-135m-instruct --port 8000      # in another shell
    python examples/server_multiturn.py --model smollm2-135m-instruct --url http://127.0.0.1:8000

It trains through trl's `rollout_func(prompts, trainer)` (grpo.trl_api). Before each call the trainer has pushed the
current policy to the server (`--vllm-mode server`), so every episode samples the policy being trained. The
function plays each episode, then returns one token sequence per episode, as trl reads it:
- `prompt_ids`: the first request's prompt as the server tokenized it;
- `completion_ids`: the model's tokens, then the environment's reply in the chat template, then the model's next
  tokens, and so on;
- `env_mask`: 0 on the environment's tokens, so the loss counts only the model's;
- `logprobs`: the server's processed log-probs of the model's tokens (0 on the environment's), for the
  importance-sampling correction;
- `solved`, `closeness`: extra keys that trl hands the reward functions as keyword arguments.

Tokens, not text: every request re-renders the whole chat, and the server returns the ids it read
(`return_token_ids`). A turn's prompt must begin with the sequence so far (the last prompt and the sampled tokens).
If a re-rendering changes earlier tokens (the reply's text tokenized another way than it was sampled), the episode
ends before that turn (`consistent` False), so no step trains on a sequence the server did not sample.
tests/test_vllm_server.py plays it against a live server and trains it for two steps.
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor

from datasets import Dataset

from grpo.generation.vllm_server import base_url
from grpo.trl_api import GRPOConfig, GRPOTrainer

MAX_TURNS = 3
HIGHEST = 20
RULES = (f"I am thinking of a whole number from 1 to {HIGHEST}. Guess it: reply with one number only. After each "
         "guess I say Higher or Lower.")


def secret_of(prompt: list[dict]) -> int:
    """The game's number, fixed by its prompt (trl hands a rollout_func the prompts only)."""
    return 1 + zlib.crc32(prompt[-1]["content"].encode()) % HIGHEST


def first_number(text: str) -> int | None:
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


def post(url: str, path: str, body: dict | None = None, timeout_s: float = 300) -> dict:
    request = urllib.request.Request(f"{url}/{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def play(url: str, model: str, prompt: list[dict], budget: int, temperature: float, seed: int) -> dict:
    """One episode over /v1/chat/completions; `budget`: the completion's tokens, the environment's included."""
    secret, messages = secret_of(prompt), [dict(message) for message in prompt]
    prompt_ids, completion_ids, env_mask, logprobs = None, [], [], []
    solved, closeness, consistent, turns = False, 0.0, True, 0
    while True:
        answer = post(url, "v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": budget - len(completion_ids),
            "temperature": temperature, "seed": seed + turns, "logprobs": True, "return_token_ids": True})
        read, choice = answer["prompt_token_ids"], answer["choices"][0]
        if prompt_ids is None:
            prompt_ids = read
        else:  # the environment's reply, as the template put it between the last reply and this turn
            sequence = prompt_ids + completion_ids
            if read[: len(sequence)] != sequence:
                consistent = False
                messages.pop()  # the environment's reply, which the episode ends before
                break
            environment = read[len(sequence):]
            if len(completion_ids) + len(environment) >= budget:
                messages.pop()
                break
            completion_ids += environment
            env_mask += [0] * len(environment)
            logprobs += [0.0] * len(environment)
        sampled = list(choice["token_ids"])
        values = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        if len(values) != len(sampled):
            raise RuntimeError(f"the server returned {len(sampled)} tokens and {len(values)} log-probs")
        completion_ids, env_mask, logprobs = completion_ids + sampled, env_mask + [1] * len(sampled), logprobs + values
        turns += 1
        reply = choice["message"]["content"] or ""
        messages.append({"role": "assistant", "content": reply})
        guess = first_number(reply)
        if guess is not None:
            closeness = max(0.0, 1 - abs(guess - secret) / HIGHEST)
        solved = guess == secret
        if solved or turns == MAX_TURNS or len(completion_ids) >= budget:
            break
        messages.append({"role": "user", "content": f"Reply with one number from 1 to {HIGHEST}." if guess is None
                         else "Higher." if guess < secret else "Lower."})
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask, "logprobs": logprobs,
            "solved": solved, "closeness": closeness, "consistent": consistent, "turns": turns,
            "messages": messages}  # the chat played, ending with the model's last reply


def rollout_func(prompts: list, trainer) -> dict:
    """trl's rollout_func: every episode at once (the server batches the requests), seeded by step and position."""
    url, args = base_url(trainer.args), trainer.args
    model = post(url, "v1/models")["data"][0]["id"]
    base = args.seed * 1_000_003 + trainer.state.global_step * 10_007
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        episodes = list(pool.map(lambda item: play(url, model, item[1], args.max_completion_length,
                                                   args.temperature, base + 97 * item[0]), enumerate(prompts)))
    return {key: [episode[key] for episode in episodes]
            for key in ("prompt_ids", "completion_ids", "env_mask", "logprobs", "solved", "closeness")}


def solved_reward(completions, solved, **kwargs) -> list[float]:
    return [1.0 if value else 0.0 for value in solved]


def closeness_reward(completions, closeness, **kwargs) -> list[float]:
    """1 - |last guess - number| / 20: a signal while the model rarely solves a game."""
    return [float(value) for value in closeness]


def games(count: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Game {index}. {RULES}"}]}
                              for index in range(count)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model the server serves (a hub id, path or local name)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the vLLM server's base URL")
    parser.add_argument("--group-port", type=int, default=51216, help="the trainer's port for the weight transfer")
    parser.add_argument("--output-dir", default="runs/server_multiturn")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU in fp32")
    args = parser.parse_args(argv)
    config = GRPOConfig(output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.learning_rate,
                        per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=1,
                        max_completion_length=96, temperature=1.0, beta=0.0, logging_steps=1,
                        save_steps=args.save_steps, report_to="none", use_cpu=args.cpu, bf16=not args.cpu,
                        use_vllm=True, vllm_mode="server", vllm_server_base_url=args.url,
                        vllm_group_port=args.group_port)
    trainer = GRPOTrainer(model=args.model, reward_funcs=[solved_reward, closeness_reward], args=config,
                          train_dataset=games(256), rollout_func=rollout_func)
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()

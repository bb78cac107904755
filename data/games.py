"""A game that no one here wrote, as a multi-turn environment: textarena's GuessTheNumber-v0 (the `games` extra).

    python train.py --model smollm2-135m-instruct --dataset runs/guess/rows.jsonl \
        --environment data.games:GuessTheNumber --reward --system-prompt "..."   # bench/environment_learning.py

The secret is a whole number from 1 to 20 drawn by textarena from the row's `seed` (so the G rollouts of a row
play the same game); the model has 10 guesses, each a call of the `guess` tool, and textarena answers "higher"
or "lower". `get_reward` is textarena's own score: 1 for a solved game, otherwise (out of guesses, or stopped
early) its partial credit 1 - |last guess - secret| / 19, and 0 before any valid guess. Nothing of textarena is
changed: the game's moves are its `[n]` actions and its messages are what the tool returns.
"""

from __future__ import annotations

import random

GAME = "GuessTheNumber-v0"

SYSTEM_PROMPT = """You are playing a game: find a secret whole number from 1 to 20. To guess, write only
<tool_call>
{"name": "guess", "arguments": {"number": 10}}
</tool_call>
and stop; the game answers in the next message whether the secret is higher or lower. Guess again until you find it."""


def _call(number: int) -> dict:
    return {"role": "assistant", "content": f'<tool_call>\n{{"name": "guess", "arguments": {{"number": {number}}}}}\n'
                                            "</tool_call>"}


EXAMPLE = [  # a worked practice game (secret 13), as the chat template shows tool turns
    {"role": "user", "content": "Let's play a practice game."},
    _call(10), {"role": "tool", "name": "guess", "content": "The target number is higher."},
    _call(15), {"role": "tool", "name": "guess", "content": "The target number is lower."},
    _call(13), {"role": "tool", "name": "guess", "content": "Congratulations! You guessed the correct number."},
    {"role": "assistant", "content": "I found it: 13."},
]


def game_rows(count: int, seed: int = 0, one_shot: bool = True) -> list[dict]:
    """`count` rows, each a game: the chat prompt (the system prompt, the worked practice game with `one_shot`,
    a user turn that reset() extends with the game's rules) and the `seed` textarena draws its secret from."""
    draw = random.Random(seed)
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *(EXAMPLE if one_shot else []),
                        {"role": "user", "content": "Let's play a new game."}],
             "seed": draw.randrange(2**31)} for _ in range(count)]


class GuessTheNumber:
    """textarena's GuessTheNumber-v0, one game per instance; `guess` is the model's only tool."""

    def __init__(self):
        import textarena  # the `games` extra; imported here so that the module loads without it

        self.game = textarena.make(GAME)
        while hasattr(self.game, "env"):  # the bare game: its messages, not the LLM wrappers' history transcript
            self.game = self.game.env
        self.done, self.outcome = False, None

    def reset(self, seed: int | None = None, **row) -> str:
        self.game.reset(num_players=1, seed=seed)
        self.done, self.outcome = False, None
        self.secret = self.game.game_number  # for reward functions and tests (a tool would show it to the model)
        self.game.get_observation()  # textarena's rules, which ask for `[n]` in the text: the tool replaces that
        game = self.game
        return f" The secret is from {game.min_number} to {game.max_number}; you have {game.max_turns} guesses."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess, a whole number from 1 to 20.
        """
        if self.done:
            return "The game is over."
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(f"number must be a whole number, got {number!r}")
        self.done, _ = self.game.step(f"[{number}]")
        if self.done:
            self.outcome = self.game.close()
            rewards, info = self.outcome
            return info[0].get("reason", "The game is over.")
        messages = [text for sender, text, _ in self.game.get_observation()[1] if sender == -1]
        return messages[-1] if messages else "Guess again."

    def get_reward(self) -> float:
        """textarena's score of the game: its outcome when it ended, else the partial credit it gives at the turn
        limit (how close the last valid guess was)."""
        if self.outcome is not None and self.outcome[0]:
            return float(self.outcome[0][0])
        return float(self.game._get_percentage_completion()) if hasattr(self.game, "state") else 0.0

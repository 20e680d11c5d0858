"""LoRA adapters written by PEFT over a tiny transformers checkpoint, and PEFT's own greedy tokens with them: the
reference pushkv's adapters are held to (tests/model/test_lora.py, tests/e2e/test_lora.py)."""
from __future__ import annotations

import torch
import transformers

NEW_TOKENS = 8
# name -> PEFT LoraConfig fields: every projection pushkv serves, and some of them under rsLoRA's scale
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def save_adapter(base: str, path: str, seed: int = 0, std: float = 0.3, **fields) -> str:
    """A PEFT adapter of ``base`` at ``path``, its A and B drawn at ``std`` (PEFT's default init leaves B zero: an
    adapter that changes nothing)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **fields))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    lora.save_pretrained(path)
    return path


def peft_reference(base: str, adapter: str | None, prompts: list[list[int]],
                   new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """PEFT's float32 greedy new tokens of each prompt (ids) through ``adapter`` (None: the base model)."""
    import peft

    out = []
    for ids in prompts:
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter)
        model.eval()
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out

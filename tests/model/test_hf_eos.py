"""Real chat checkpoints end where they should: a small Llama-3-style checkpoint (a list of EOS ids
in config.json and generation_config.json, as Llama-3.1-Instruct has) and a Qwen3-style one (one
id in config.json, two in generation_config.json), each with the checkpoint's sampling defaults.
transformers' greedy ``generate``, which reads the same files, is the reference for where each
prompt's output stops; pushkv serves them (push for Llama, local for Qwen3) and stops there too.
A request that leaves temperature unset samples with the checkpoint's defaults."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.support.deploy import deployment, wait_pools_free
from tests.model.test_hf_reference import FLOAT32, PROMPTS, save_hf_checkpoint

pytestmark = pytest.mark.timeout(300)

NEW = 12  # tokens a prompt may run to


def free_run(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with nothing to stop on."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[0, len(ids):].tolist()


def eos_for(runs: list[list[int]]) -> list[int]:
    """Ids that end some prompts partway: prompt i's token at position 2 + i (if new in its run),
    and one id no run produces (the 'end of text' a model rarely emits)."""
    seen = {t for r in runs for t in r}
    never = next(t for t in range(4, 300) if t not in seen)
    picks = []
    for i, r in enumerate(runs[:2]):
        k = next(k for k in range(2 + i, len(r)) if r[k] not in r[:k] and r[k] not in picks)
        picks.append(r[k])
    return [never, *picks]


def write_checkpoint(path: str, arch: str, seed: int) -> tuple[list, list[int], dict]:
    """A checkpoint whose EOS ids stop the first two prompts partway; its files, like the real
    model's: Llama-3 lists every id in both, Qwen3 names one in config.json and more in
    generation_config.json."""
    save_hf_checkpoint(path, arch, seed)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    eos = eos_for([free_run(model, ids, NEW) for ids in prompt_ids])
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if arch == "llama":
        hf["eos_token_id"], gen_eos = eos, eos
        defaults = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    else:
        hf["eos_token_id"], gen_eos = eos[0], eos
        defaults = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 2, "eos_token_id": gen_eos, "pad_token_id": 0, **defaults}, f)
    return prompt_ids, eos, defaults


def hf_stops(path: str, prompt_ids: list) -> list[list[int]]:
    """transformers' greedy generate, reading the checkpoint's own files (its EOS list included)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id is not None
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, temperature=None,
                                 top_p=None, top_k=None)
            out.append(gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch, mode", [("llama", "push"), ("qwen3", "local")])
def test_generation_stops_where_transformers_stops(tmp_path, arch, mode):
    path = str(tmp_path / arch)
    prompt_ids, eos, defaults = write_checkpoint(path, arch, seed=3)
    want = hf_stops(path, prompt_ids)
    assert [len(w) < NEW for w in want[:2]] == [True, True]  # the EOS list ends both early
    assert want[0][-1] == eos[1] and want[1][-1] == eos[2]  # on the 2nd and 3rd id of the list
    d = tmp_path / "dep"
    d.mkdir()
    with deployment(d, "--mode", mode, "--checkpoint", path, "--num-blocks", "64", *FLOAT32) as dep:
        for prompt, ids, w in zip(PROMPTS, prompt_ids, want):
            body = dep.complete(prompt, NEW, temperature=0)  # the checkpoint says 0.6: the request wins
            choice = body["choices"][0]
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert choice["token_ids"] == w, prompt
            assert choice["finish_reason"] == ("stop" if len(w) < NEW else "length"), prompt
        # unset fields take the checkpoint's defaults: the same draw as naming them
        ignore = {"ignore_eos": True, "seed": 7}
        unset = dep.complete(PROMPTS[2], NEW, **ignore)["choices"][0]["token_ids"]
        named = dep.complete(PROMPTS[2], NEW, **ignore, **{k: v for k, v in defaults.items() if k != "do_sample"})
        greedy = dep.complete(PROMPTS[2], NEW, **ignore, temperature=0)["choices"][0]["token_ids"]
        assert unset == named["choices"][0]["token_ids"] and len(unset) == NEW
        assert unset != greedy  # sampled, not pushkv's greedy default
        wait_pools_free(dep)

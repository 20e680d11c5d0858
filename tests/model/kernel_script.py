"""Helpers of the kernel tests that run a script in a child process: the kernels themselves where there is a GPU,
else under Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is imported, so a child)."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_kernel_script(script: str, timeout_s: float = 300) -> str:
    """Run ``script`` (it prints "ok ..." last when its checks pass); its stdout, asserted to end so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout_s)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("ok"), r.stderr[-3000:]
    return r.stdout


def decode_step(model, dev: str):
    """(a decode step of three sequences, the pool their prompts were prefilled into) for ``model`` on ``dev``."""
    from pushkv.messages import SeqWork
    from tests.model.test_model import new_pool, prompt_of

    seqs = [SeqWork(i, tuple(prompt_of(9 + 4 * i, seed=i)), 0, tuple(range(4 * i, 4 * i + 4))) for i in range(3)]
    pool = new_pool(model, 16, 8).to(dev)
    model.execute(seqs, pool)
    return [SeqWork(i, (3 + i,), 9 + 4 * i, s.block_table) for i, s in enumerate(seqs)], pool


def logits_off_and_on(fwd, step, pool, module, bound: str, on: int, owner, name: str):
    """(logits of ``step`` with ``module.bound`` at 0, the same at ``on``, the calls made meanwhile of
    ``owner.name``, which is wrapped to count them), each run on a copy of ``pool``."""
    calls = []
    real = getattr(owner, name)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    setattr(owner, name, counted)
    out = {}
    for value in (0, on):
        setattr(module, bound, value)
        out[value] = fwd.logits(step, fwd.m._layer_pools(pool.clone()))
    return out[0], out[on], len(calls)

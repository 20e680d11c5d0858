"""Torch dtypes by the names configs use: the one table, for the pool and the model.

Apart from ``config.py`` (whose ``DTYPE_BYTES`` sizes them) so that processes
that never compute (router, supervisor, scheduler) do not import torch.
"""
from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

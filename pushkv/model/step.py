"""One forward step's index arrays, built once on the host and shipped in one copy.

Sequences are packed token after token. ``plan_step`` (pure numpy, no torch) turns a
step's ``SeqWork`` list into the arrays every layer shares: token ids, positions, the
flat pool slot each new token's K/V goes to, the padded block table, per-sequence
query rows and lengths, the attention tiles, and the rows whose logits are sampled.
``StepTensors.upload`` packs them into one pinned int32 buffer and copies it to the
device with one asynchronous copy, so building a step never waits on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pushkv.messages import SeqWork

_FIELDS = ("ids", "positions", "slots", "seq_lens", "q_starts", "q_lens", "decode_tiles", "decode_q0",
           "prefill_tiles", "prefill_q0", "sample_rows", "lora")


@dataclass
class StepPlan:
    ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slots: np.ndarray  # int32 [T]: block * U + offset, -1 = do not store
    block_table: np.ndarray  # int32 [S, W]
    seq_lens: np.ndarray  # int32 [S]: keys of each sequence after this step
    q_starts: np.ndarray  # int32 [S]: row of its first new token
    q_lens: np.ndarray  # int32 [S]
    decode_tiles: np.ndarray  # int32: sequences with one new token (one tile each)
    decode_q0: np.ndarray
    prefill_tiles: np.ndarray  # int32: (sequence, first query) of each block_q tile
    prefill_q0: np.ndarray
    sample_rows: np.ndarray  # int32: rows whose logits are returned
    block_q: int
    lora: np.ndarray  # int32 [T]: each row's LoRA slot (0: none)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence runs one token and is sampled: the shape CUDA graphs replay."""
        return self.num_tokens == self.num_seqs and self.sample_rows.shape[0] == self.num_seqs


def plan_step(seqs: Sequence[SeqWork], block_size: int, block_q: int, width: int = 0) -> StepPlan:
    """Index arrays of one step; block tables name physical (sub-)blocks of block_size slots.
    width pads the block table to at least that many columns."""
    lens = np.fromiter((len(s.token_ids) for s in seqs), np.int32, len(seqs))
    starts = np.fromiter((s.start_pos for s in seqs), np.int32, len(seqs))
    q_starts = np.zeros(len(seqs), np.int32)
    if len(seqs):
        np.cumsum(lens[:-1], out=q_starts[1:])
    T = int(lens.sum())
    ids = np.empty(T, np.int32)
    lora = np.zeros(T, np.int32)
    positions = np.empty(T, np.int32)
    slots = np.empty(T, np.int32)
    need = [-(-(st + n) // block_size) for st, n in zip(starts.tolist(), lens.tolist())]
    W = max([width, 1] + need)
    table = np.zeros((len(seqs), W), np.int32)
    sample = []
    for i, s in enumerate(seqs):
        r0, n, st = int(q_starts[i]), int(lens[i]), int(starts[i])
        bt = np.asarray(s.block_table[:need[i]], np.int32)
        table[i, :bt.shape[0]] = bt
        ids[r0:r0 + n] = s.token_ids
        lora[r0:r0 + n] = s.lora
        pos = np.arange(st, st + n, dtype=np.int32)
        positions[r0:r0 + n] = pos
        slots[r0:r0 + n] = bt[pos // block_size] * block_size + pos % block_size
        if s.sample:
            sample.append(r0 + n - 1)
    one = lens == 1
    dec = np.nonzero(one)[0].astype(np.int32)
    pre_seq, pre_q0 = [], []
    for i in np.nonzero(~one)[0].tolist():
        for q0 in range(0, int(lens[i]), block_q):
            pre_seq.append(i)
            pre_q0.append(q0)
    return StepPlan(ids, positions, slots, table, starts + lens, q_starts, lens, dec,
                    np.zeros(dec.shape[0], np.int32), np.asarray(pre_seq, np.int32),
                    np.asarray(pre_q0, np.int32), np.asarray(sample, np.int32), block_q, lora)


@dataclass
class StepTensors:
    """A StepPlan on the device (int32 views into one buffer)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    decode_tiles: torch.Tensor
    decode_q0: torch.Tensor
    prefill_tiles: torch.Tensor
    prefill_q0: torch.Tensor
    sample_rows: torch.Tensor
    block_table: torch.Tensor
    block_q: int
    lora: torch.Tensor  # int32 [T]: each row's LoRA slot
    # on the host: (first row, length) of each sequence where every sequence of the step takes all its keys anew
    # (a whole prompt, or a chunked prompt's first chunk), in sequence order; else empty
    whole: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def upload(plan: StepPlan, device: torch.device, staging: Optional["Staging"] = None) -> "StepTensors":
        parts = [getattr(plan, f) for f in _FIELDS] + [plan.block_table.reshape(-1)]
        sizes = [p.shape[0] for p in parts]
        # every array starts 16-byte aligned in the one buffer: Triton specialises pointer
        # arguments on it, so unaligned views compiled new kernel variants mid-serving
        starts = np.cumsum([0] + [-(-n // ALIGN_INT32) * ALIGN_INT32 for n in sizes])
        total = int(starts[-1])
        stage = (staging or Staging()) if device.type == "cuda" else None
        pinned = stage.take(total)[:total] if stage is not None else torch.from_numpy(np.zeros(total, np.int32))
        host = pinned.numpy()
        for p, a, n in zip(parts, starts, sizes):
            host[a:a + n] = p
        if stage is not None:
            dev = pinned.to(device, non_blocking=True)
            stage.copied()
        else:
            dev = pinned
        views = [dev[a:a + n] for a, n in zip(starts.tolist(), sizes)]
        table = views.pop().view(plan.block_table.shape)
        return StepTensors(**dict(zip(_FIELDS, views)), block_table=table, block_q=plan.block_q,
                           whole=whole_prompts(plan))


ALIGN_INT32 = 4  # 16 bytes


def whole_prompts(plan: StepPlan) -> tuple[tuple[int, int], ...]:
    """(first row, length) of each of the plan's sequences where each one's keys are all new this step (no key
    before its first new token); empty where any sequence has earlier keys or no new token."""
    if not plan.num_seqs or not np.array_equal(plan.q_lens, plan.seq_lens) or not plan.q_lens.all():
        return ()
    return tuple(zip(plan.q_starts.tolist(), plan.q_lens.tolist()))


class Staging:
    """A reusable pinned host buffer for one asynchronous copy at a time. Before it is
    written again it waits for the last copy out of it: free in serving (that copy ended
    before the step's tokens were read), and what keeps back-to-back steps with no read
    between them (the batch-invariant mode runs one per sequence) from overwriting
    indices still in flight."""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.int32)
        self.event = None

    def copied(self) -> None:
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record()

    def take(self, n: int) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        if self.buf.numel() < n:
            # (zeros: a decode graph's one copy lands the entries past each row's width too, which no kernel reads,
            # but they are then block ids, never garbage)
            self.buf = torch.zeros(max(n, 2 * self.buf.numel(), 4096), dtype=torch.int32,
                                   pin_memory=torch.cuda.is_available())
        return self.buf

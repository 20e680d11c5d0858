"""Checksums of a request's KV, so D can verify what landed (``--kv-verify``).

What is summed is the KV's logical content, not its bytes where they lie, so P and D
compute the same numbers whatever their layouts (TP sizes, block sizes, head groups):

- a **unit** is ``unit_tokens`` consecutive prompt tokens (P's block size, a whole number
  of sub-blocks on both sides); a **row** is one global KV head; a row holds one sum per
  (layer group, unit checked). A unit of a sliding-window group that the transfer does not
  move (before the window, rounded down to a sub-block as ``protocol/mapping.py`` moves it)
  is not checked and holds 0. Tokens past the prompt are masked out.
- a sum is ``sum_i w_i * x_i mod 2**64`` over the unit's words ``x_i`` (the KV's bytes read
  as int32, or int16 where a head's row is not a multiple of 4 bytes), for every layer of the
  group, plane and token of the unit, with odd weights ``w_i`` hashed from the word's
  position (layer, plane, token in unit, word). An odd weight makes every change of a single
  word change the sum; position weights catch words moved inside a unit; the unit and head
  keys catch whole blocks or heads that landed in the wrong place (a swap, a stale block).

``sample`` checks the first and the last unit and ``SAMPLE_EXTRA`` more at positions hashed
from a salt; ``full`` checks every unit. The pure parts (which units, merging ranks' rows,
comparing) are here and table-tested; ``unit_sums`` is the torch reference, and
``model/kernels/triton_checksum.py`` computes the same on CUDA. D compares where its sums
are (``verify``: on the GPU, one reduction, two numbers to the host; ``compare`` is its host
reference). On the wire the sums are packed bytes (``pack``, ``rows``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from pushkv.config import KVVerify
from pushkv.kv.layout import KVLayout, expand_table, layer_groups, unit, window_group
from pushkv.messages import KVChecksums

MODES = ("off", "sample", "full")
SAMPLE_EXTRA = 2  # sample: units checked besides the first and the last

MASK64 = (1 << 64) - 1
# splitmix64's constants, as the signed int64 values torch and Triton compute with
C1 = 0x9E3779B97F4A7C15 - (1 << 64)
C2 = 0xBF58476D1CE4E5B9 - (1 << 64)


def _signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def mix(i: int) -> int:
    """The weight hash on Python ints, exactly as the tensor versions compute it on int64:
    wrapping multiplies and arithmetic right shifts, then odd."""
    x = _signed(i * C1)
    x = _signed(x ^ (x >> 31))
    x = _signed(x * C2)
    x = x ^ (x >> 29)
    return _signed(x | 1)


def n_units(num_tokens: int, unit_tokens: int) -> int:
    return -(-num_tokens // unit_tokens)


def plan_units(mode: KVVerify, num_tokens: int, unit_tokens: int, salt: int = 0) -> tuple[int, ...]:
    """The units a transfer's checksums cover: none (off), all (full), or the first, the last
    and ``SAMPLE_EXTRA`` hashed from ``salt`` (sample). Sorted, distinct."""
    if mode not in MODES:
        raise ValueError(f"kv verify mode {mode!r} is not one of {MODES}")
    n = n_units(num_tokens, unit_tokens)
    if mode == "off" or n == 0:
        return ()
    if mode == "full" or n <= SAMPLE_EXTRA + 2:
        return tuple(range(n))
    picked = {0, n - 1}
    k = 0
    while len(picked) < SAMPLE_EXTRA + 2:
        picked.add((mix(salt * 1000003 + k) & MASK64) % n)
        k += 1
    return tuple(sorted(picked))


def group_first_token(lay: KVLayout, group: int, num_tokens: int) -> int:
    """First token layer group ``group`` moves: 0, or for the sliding-window group the start of
    the window rounded down to a whole sub-block (what ``protocol/mapping.py`` moves)."""
    if group != window_group(lay):
        return 0
    return max(0, num_tokens - lay.window) // unit(lay) * unit(lay)


def checked_units(lay: KVLayout, group: int, units: Sequence[int], unit_tokens: int, num_tokens: int) -> list[bool]:
    """Which of ``units`` layer group ``group`` checks (a window group: only whole units it moves)."""
    first = group_first_token(lay, group, num_tokens)
    return [u * unit_tokens >= first for u in units]


def word_bytes(lay: KVLayout) -> int:
    """Bytes per summed word: 4 where a head's row (head_dim x dtype) is a multiple of 4, else 2."""
    row = lay.head_dim * lay.dtype_bytes
    return 4 if row % 4 == 0 else 2


def check_unit_tokens(lay: KVLayout, unit_tokens: int) -> None:
    if unit_tokens <= 0 or unit_tokens % unit(lay):
        raise ValueError(f"checksum unit of {unit_tokens} tokens is not whole sub-blocks of {unit(lay)}")


def sub_rows(lay: KVLayout, table: Sequence[int], units: Sequence[int], unit_tokens: int) -> list[int]:
    """The physical sub-block of each (unit, sub-block of the unit), unit-major. A unit's tail
    past the blocks this side holds (only tokens past the prompt lie there, masked) reads
    sub-block ``table[0]``'s first instead."""
    subs = expand_table(lay, table)
    spu = unit_tokens // unit(lay)
    return [subs[j] if j < len(subs) else subs[0] for u in units for j in range(u * spu, (u + 1) * spu)]


# ------------------------------------------------------------------ rows <-> wire
SUM_BYTES = 8  # a sum on the wire: little-endian int64


def pack(rows: Sequence[Sequence[int]]) -> bytes:
    """Rows of signed 64-bit ints -> ``KVChecksums.sums``."""
    import numpy as np

    return np.asarray([list(r) for r in rows] if rows else [], dtype="<i8").tobytes()


def rows(exp: KVChecksums) -> list[tuple[int, ...]]:
    """``exp.sums`` as one tuple of ints per head (its row), in ``exp.heads`` order."""
    import numpy as np

    if not exp.heads:
        return []
    flat = np.frombuffer(exp.sums, dtype="<i8")
    return [tuple(r) for r in flat.reshape(len(exp.heads), -1).tolist()]


def _row_bytes(exp: KVChecksums) -> int:
    if not exp.heads or len(exp.sums) % (len(exp.heads) * SUM_BYTES):
        raise ValueError(f"{len(exp.sums)} bytes of checksums do not split into {len(exp.heads)} rows")
    return len(exp.sums) // len(exp.heads)


def to_wire(lay: KVLayout, sums, units: Sequence[int], unit_tokens: int, num_tokens: int) -> KVChecksums:
    """``sums`` ``[groups, len(units), local heads]`` int64 (a tensor on any device: one copy to
    the host) -> the wire struct, rows by global head."""
    host = sums.permute(2, 0, 1).contiguous().cpu()  # [heads, groups, units]
    heads = tuple(lay.head_start + h for h in range(lay.kv_heads))
    return KVChecksums(unit_tokens, num_tokens, tuple(units), heads, host.numpy().astype("<i8").tobytes())


def merge(parts: Sequence[Optional[KVChecksums]]) -> Optional[KVChecksums]:
    """One struct from every rank's (rows by global head, the first rank's row of a head that
    several ranks hold). None when no rank sent any."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    first = present[0]
    by_head: dict[int, bytes] = {}
    for p in present:
        if (p.unit_tokens, p.num_tokens, p.units) != (first.unit_tokens, first.num_tokens, first.units):
            raise ValueError("ranks' checksums cover different units")
        size = _row_bytes(p)
        for i, h in enumerate(p.heads):
            by_head.setdefault(h, p.sums[i * size:(i + 1) * size])
    heads = tuple(sorted(by_head))
    return KVChecksums(first.unit_tokens, first.num_tokens, first.units, heads, b"".join(by_head[h] for h in heads))


def _mismatch(exp: KVChecksums, head: int, g: int, i: int) -> str:
    u = exp.units[i]
    t0 = u * exp.unit_tokens
    t1 = min(t0 + exp.unit_tokens, exp.num_tokens)
    return f"KV checksum mismatch: tokens {t0}..{t1 - 1} (unit {u}), layer group {g}, KV head {head}"


def _rows_fit(lay: KVLayout, exp: KVChecksums) -> bool:
    return len(exp.sums) == SUM_BYTES * len(exp.heads) * len(layer_groups(lay)) * len(exp.units)


def compare(lay: KVLayout, expected: KVChecksums, got: KVChecksums) -> tuple[str, int]:
    """``(reason, sums compared)``: reason is "" when every sum this side checks matches, else
    names the first (head, layer group, unit) that differs, or the first head P sent no row
    for. The host reference of ``verify``, which D's workers run where the sums are."""
    if (got.unit_tokens, got.num_tokens, got.units) != (expected.unit_tokens, expected.num_tokens, expected.units):
        return "checksums cover different units on the two sides", 0
    groups = len(layer_groups(lay))
    n = len(expected.units)
    want = dict(zip(expected.heads, rows(expected))) if _rows_fit(lay, expected) else {}
    compared = 0
    for h, row in zip(got.heads, rows(got)):
        exp = want.get(h)
        if exp is None or len(row) != groups * n:
            return f"no checksum from P for KV head {h}", compared
        for g in range(groups):
            keep = checked_units(lay, g, expected.units, expected.unit_tokens, expected.num_tokens)
            for i in range(n):
                if not keep[i]:
                    continue
                compared += 1
                if row[g * n + i] != exp[g * n + i]:
                    return _mismatch(expected, h, g, i), compared
    return "", compared


def verify(lay: KVLayout, expected: KVChecksums, sums) -> tuple[str, int]:
    """D's check of this rank's ``sums`` (``[groups, len(expected.units), local heads]``, on its
    device) against P's: ``compare``'s answer, computed where the sums are. P's rows go up in
    one copy; one reduction leaves the mismatch count and the first mismatching (head, group,
    unit) in ``compare``'s order, and only those two numbers come back to the host."""
    import numpy as np
    import torch

    groups = len(layer_groups(lay))
    n = len(expected.units)
    at = {h: i for i, h in enumerate(expected.heads)} if _rows_fit(lay, expected) else {}
    mine = [lay.head_start + h for h in range(lay.kv_heads)]
    missing = next((k for k, h in enumerate(mine) if h not in at), None)
    heads = mine if missing is None else mine[:missing]  # compare stops at the first head P sent nothing for
    keep = [checked_units(lay, g, expected.units, expected.unit_tokens, expected.num_tokens) for g in range(groups)]
    per_head = sum(map(sum, keep))
    count = 0
    if heads and per_head:
        rows = np.frombuffer(expected.sums, dtype="<i8").reshape(len(expected.heads), groups * n)
        exp = rows[[at[h] for h in heads]].reshape(-1)
        host = torch.from_numpy(np.concatenate([exp, np.asarray(keep, dtype=np.int64).reshape(-1)]))
        up = host.to(sums.device, non_blocking=True)  # the one copy up
        want = up[:exp.size].view(len(heads), groups, n)
        bad = (sums[:, :, :len(heads)].permute(2, 0, 1) != want) & up[exp.size:].view(1, groups, n).bool()
        flat = bad.reshape(-1).to(torch.int32)
        count, first = torch.stack([flat.sum(), torch.argmax(flat)]).tolist()  # the one copy down
    if count:
        hi, rest = divmod(first, groups * n)
        g, i = divmod(rest, n)
        return _mismatch(expected, heads[hi], g, i), hi * per_head + sum(map(sum, keep[:g])) + sum(keep[g][:i + 1])
    if missing is not None:
        return f"no checksum from P for KV head {mine[missing]}", missing * per_head
    return "", per_head * len(mine)


# ------------------------------------------------------------------ torch reference
def weights(layer: int, planes: int, unit_tokens: int, words: int, device=None):
    """``[planes, unit_tokens, words]`` int64 weights of one layer: ``mix`` of the word's
    position ((layer * planes + plane) * unit_tokens + token) * words + word."""
    import torch

    i = torch.arange(planes * unit_tokens * words, dtype=torch.int64, device=device)
    i = i + layer * planes * unit_tokens * words
    x = i * C1
    x = x ^ (x >> 31)
    x = x * C2
    x = x ^ (x >> 29)
    return (x | 1).view(planes, unit_tokens, words)


def _words(x, lay: KVLayout):
    import torch

    return x.contiguous().view(torch.int32 if word_bytes(lay) == 4 else torch.int16)


def unit_sums(views, lay: KVLayout, table: Sequence[int], num_tokens: int, units: Sequence[int],
              unit_tokens: int):
    """``[groups, len(units), local heads]`` int64 sums of one rank's pool (torch; any device).

    ``views`` are the pool's per-layer views (``layout.layer_views``); ``table`` is the
    request's logical block table on this side."""
    import torch

    check_unit_tokens(lay, unit_tokens)
    groups = layer_groups(lay)
    nu = len(units)
    dev = views[0].device
    out = torch.zeros(len(groups), nu, lay.kv_heads, dtype=torch.int64, device=dev)
    if not nu:
        return out
    sub, spu = unit(lay), unit_tokens // unit(lay)
    rows = torch.tensor(sub_rows(lay, table, units, unit_tokens), dtype=torch.int64, device=dev)
    tok = torch.tensor(units, dtype=torch.int64, device=dev)[:, None] * unit_tokens + torch.arange(
        unit_tokens, device=dev)
    live = (tok < num_tokens).to(torch.int64)  # [units, unit_tokens]
    planes = lay.kv_planes
    for g, layers in enumerate(groups):
        keep = torch.tensor(checked_units(lay, g, units, unit_tokens, num_tokens), device=dev)
        for layer in layers:
            # [units*spu, planes, (groups, group heads,) sub, head_dim]; index_select: indexing the
            # strided view with a tensor costs time in the pool's size, not the rows'
            x = torch.index_select(views[layer], 0, rows)
            x = x.reshape(nu, spu, planes, lay.kv_heads, sub, lay.head_dim)
            x = x.permute(0, 3, 2, 1, 4, 5).reshape(nu, lay.kv_heads, planes, unit_tokens, lay.head_dim)
            w = _words(x, lay).to(torch.int64)  # [units, heads, planes, tokens, words]
            wt = weights(layer, planes, unit_tokens, w.shape[-1], dev) * live[:, None, None, :, None]
            s = (w * wt).sum(dim=(2, 3, 4))
            out[g] += s * keep[:, None]
    return out


def moved_units(exp: KVChecksums, first_token: int) -> Optional[KVChecksums]:
    """``exp`` less the units before ``first_token``: D's prefix-cache hits, which never crossed
    (their KV is D's own, and where D's decode computed it, it may differ from P's in the last
    bits). None when no unit is left."""
    import numpy as np

    keep = [i for i, u in enumerate(exp.units) if u * exp.unit_tokens >= first_token]
    if len(keep) == len(exp.units):
        return exp
    if not keep:
        return None
    n = len(exp.units)
    # [heads, groups, units] (no heads: P sent no rows, and D's workers will say so)
    table = np.frombuffer(exp.sums, dtype="<i8").reshape(len(exp.heads), -1 if exp.heads else 0, n)
    return KVChecksums(exp.unit_tokens, exp.num_tokens, tuple(exp.units[i] for i in keep), exp.heads,
                       np.ascontiguousarray(table[:, :, keep]).tobytes())


def check_expected(exp: KVChecksums, num_tokens: int, unit_tokens: int, groups: int) -> Optional[str]:
    """Why P's checksums (from a peer) cannot be checked against this request, or None."""
    if exp.num_tokens != num_tokens:
        return f"checksums cover {exp.num_tokens} tokens, the prompt has {num_tokens}"
    if exp.unit_tokens != unit_tokens:
        return f"checksum unit of {exp.unit_tokens} tokens, expected {unit_tokens}"
    n = n_units(num_tokens, unit_tokens)
    if not exp.units or any(not 0 <= u < n for u in exp.units) or list(exp.units) != sorted(set(exp.units)):
        return f"checksum units {list(exp.units)[:8]} are not distinct sorted units of [0, {n})"
    if len(exp.sums) != SUM_BYTES * len(exp.heads) * groups * len(exp.units):
        return "checksum rows do not match their heads, layer groups and units"
    return None

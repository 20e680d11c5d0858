"""The deployment's cost model, learned online from the stage timings requests already carry.

Pure: no sockets, no clock. The router feeds it each finished request (``samples``: what one
request's merged timeline says) and asks it what a choice costs (``CostModel.costs``). The
planner (``pushkv.plan``) reads the same ``Costs``.

Three linear fits, each over a window of the latest samples:

- **prefill**: ``ms = fixed * steps + per_token * computed + per_cached * cached`` (P's
  ``prefill_start`` .. ``prefill_end``). The regressors are what the steps that computed the
  prompt computed in all (P reports them: a step may prefill several prompts, and each of them
  waits for all), else the prompt's own uncached and cached tokens. Only P's prefills are
  samples (D's own prefills are the local fit's);
- **handoff** P -> D: ``ms = fixed + per_block * moved_blocks`` (from the later of P's
  ``prefill_end`` and D's registration or READ post, to D's ``kv_received``: the WRITE or READ
  and its rendezvous; D's own queue for blocks is not the link's cost);
- **local prefill** on D (conditional disaggregation: D prefills a prompt itself):
  ``ms = fixed + per_token * computed``, from D's ``prefill_start`` .. ``prefill_end`` of the
  prompt: the step that prefilled it, D's decodes in it included. The cached prefix is not a
  regressor: a turn D prefills is a short suffix over a long cached history, so the cached
  tokens barely vary against the fixed part and the two cannot be told apart (the fixed part
  carries both). ``Costs.local_prefill_ms`` prices a prefill on D with it once D has prefilled
  something, and at P's prices before (the same hardware); P is priced at D's while P has
  prefilled nothing;
- **decode step** on D: ``ms = fixed + per_seq * batch + per_kctx * batch * context / 1000``
  (a request's time per output token against the mean batch and context of the steps that
  decoded it, as D reports them). A request whose steps also prefilled a prompt on D is no step
  sample: what the prefill added to its tokens is not the batch's cost.

A fit starts at its prior (``PRIORS``: CPU-sized values) and moves to the data as samples come:
while a window holds fewer than ``ENOUGH`` samples the prior enters as ``PRIOR_WEIGHT``
pseudo-samples (a handful of real ones already dominate, one outlier cannot throw the fit far);
past it, only as a faint ridge (``RIDGE``) that settles what the data leave open (every sample
of one size says nothing of the split between intercept and slope). Samples more than ``OUTLIER_MADS`` median
absolute deviations off the first fit are dropped and the fit redone (a GC pause, a step shared
with someone else's prefill). Coefficients never go below zero.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

# numpy is imported with the module, so at the router's start: imported at the first fit instead,
# it held the router's loop for the import (40-200 ms) while it placed its second request
import numpy as np

from pushkv.config import Role

WINDOW = 256  # samples per fit
PRIOR_WEIGHT = 2.0  # pseudo-samples the prior is worth while a window is short
ENOUGH = 16  # samples past which the data alone decide (the prior only breaks ties)
RIDGE = 1e-4  # the prior's weight then
OUTLIER_MADS = 5.0

# per fit: (parameter names, prior values, scale of each regressor in a typical sample)
PRIORS = {
    "prefill": (("prefill_ms_fixed", "prefill_ms_per_token", "prefill_ms_per_cached_token"),
                (5.0, 1.0, 0.01), (1.0, 512.0, 512.0)),
    "handoff": (("handoff_ms_fixed", "handoff_ms_per_block"), (5.0, 0.2), (1.0, 32.0)),
    "local": (("local_prefill_ms_fixed", "local_prefill_ms_per_token"), (5.0, 1.0), (1.0, 512.0)),
    "step": (("step_ms_fixed", "step_ms_per_seq", "step_ms_per_kctx"), (20.0, 5.0, 5.0), (1.0, 4.0, 4.0)),
}


@dataclass(frozen=True)
class Costs:
    """Fitted parameters (ms) and how many samples each fit has seen."""

    prefill_ms_fixed: float = PRIORS["prefill"][1][0]
    prefill_ms_per_token: float = PRIORS["prefill"][1][1]
    prefill_ms_per_cached_token: float = PRIORS["prefill"][1][2]
    handoff_ms_fixed: float = PRIORS["handoff"][1][0]
    handoff_ms_per_block: float = PRIORS["handoff"][1][1]
    step_ms_fixed: float = PRIORS["step"][1][0]
    step_ms_per_seq: float = PRIORS["step"][1][1]
    step_ms_per_kctx: float = PRIORS["step"][1][2]
    local_prefill_ms_fixed: float = PRIORS["local"][1][0]
    local_prefill_ms_per_token: float = PRIORS["local"][1][1]
    prefill_samples: int = 0
    handoff_samples: int = 0
    step_samples: int = 0
    local_samples: int = 0

    def prefill_ms(self, computed: int, cached: int = 0) -> float:
        return self.prefill_ms_fixed + self.prefill_ms_per_token * computed + self.prefill_ms_per_cached_token * cached

    def handoff_ms(self, blocks: int) -> float:
        return self.handoff_ms_fixed + self.handoff_ms_per_block * blocks

    def step_ms(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences of mean ``context`` tokens."""
        return self.step_ms_fixed + self.step_ms_per_seq * batch + self.step_ms_per_kctx * batch * context / 1000.0

    def local_prefill_ms(self, computed: int, cached: int = 0) -> float:
        """D prefilling a prompt itself: D's own measured prices once D has prefilled something,
        P's before (the same hardware)."""
        if not self.local_samples:
            return self.prefill_ms(computed, cached)
        return self.local_prefill_ms_fixed + self.local_prefill_ms_per_token * computed

    @property
    def local_ms_per_token(self) -> float:
        """The rate a prompt token D prefills costs D's step."""
        return self.local_prefill_ms_per_token if self.local_samples else self.prefill_ms_per_token

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Sample:
    """One observation for one fit: regressors (leading 1 for the intercept) and the ms seen."""

    fit: str  # "prefill" | "handoff" | "step"
    x: tuple[float, ...]
    ms: float


def fit_linear(xs, ys, prior, scale, outlier_mads: float = OUTLIER_MADS):
    """Least squares with the prior as pseudo-samples (ridge toward ``prior``), one pass of
    outlier removal, coefficients clipped at zero (numpy arrays in and out)."""

    def solve(x, y):
        prior_weight = PRIOR_WEIGHT if len(y) < ENOUGH else RIDGE
        # a pseudo-sample per parameter: regressor = its typical size, target = prior's share
        px = np.diag(scale) * np.sqrt(prior_weight)
        py = px @ prior
        a = np.vstack([x, px]) if len(x) else px
        b = np.concatenate([y, py]) if len(y) else py
        theta = np.linalg.lstsq(a, b, rcond=None)[0]
        return np.maximum(theta, 0.0)

    theta = solve(xs, ys)
    if len(ys) >= 8:
        resid = np.abs(ys - xs @ theta)
        mad = float(np.median(np.abs(resid - np.median(resid)))) or 1e-9
        keep = resid <= np.median(resid) + outlier_mads * mad
        if not keep.all():
            theta = solve(xs[keep], ys[keep])
    return theta


class CostModel:
    """Windows of samples per fit and the ``Costs`` they give (refitted lazily)."""

    def __init__(self, window: int = WINDOW):
        self.windows: dict[str, deque[Sample]] = {k: deque(maxlen=window) for k in PRIORS}
        self.seen = {k: 0 for k in PRIORS}
        self._costs: Optional[Costs] = Costs()

    def add(self, samples) -> None:
        for s in samples:
            if s.fit not in self.windows or not math.isfinite(s.ms) or s.ms < 0:
                continue
            self.windows[s.fit].append(s)
            self.seen[s.fit] += 1
            self._costs = None

    @property
    def costs(self) -> Costs:
        if self._costs is None:
            values: dict[str, float] = {}
            for fit, (names, prior, scale) in PRIORS.items():
                w = self.windows[fit]
                xs = np.array([s.x for s in w], dtype=float).reshape(len(w), len(names))
                ys = np.array([s.ms for s in w], dtype=float)
                theta = fit_linear(xs, ys, np.array(prior, dtype=float), np.array(scale, dtype=float))
                values.update(zip(names, (float(t) for t in theta)))
            if not self.windows["prefill"] and self.windows["local"]:  # P has prefilled nothing: D's prices
                values["prefill_ms_fixed"] = values["local_prefill_ms_fixed"]
                values["prefill_ms_per_token"] = values["local_prefill_ms_per_token"]
            self._costs = Costs(**values, prefill_samples=self.seen["prefill"], handoff_samples=self.seen["handoff"],
                                step_samples=self.seen["step"], local_samples=self.seen["local"])
        return self._costs


def samples(timeline: dict[str, float], prompt_tokens: int, output_tokens: int, *, prefill_leg: Role,
            cached_tokens: int, moved_blocks: int, decode_batch: float, prefill_work: tuple = (),
            decode_work: tuple = ()) -> list[Sample]:
    """What one finished request's merged timeline (``<leg>.<stage>`` -> wall seconds) says.

    ``prefill_leg``: the leg that prefilled ("prefill", or "decode" when D prefilled it
    itself); ``cached_tokens``: that leg's prefix-cache hits; ``moved_blocks``: blocks that
    crossed P -> D (no handoff sample when none did); ``decode_batch``: the router's guess of
    D's batch (its legs on D) when D did not report ``decode_work``; ``prefill_work``: P's
    (steps, tokens computed, cached context) over the steps that computed the prompt;
    ``decode_work``: D's (steps, sequences, context tokens, prefill tokens) over the steps that
    decoded it."""
    out: list[Sample] = []
    start, end = timeline.get("prefill.prefill_start"), timeline.get("prefill.prefill_end")
    if prefill_leg == "prefill" and start is not None and end is not None and end >= start:
        if prefill_work and prefill_work[0] > 0:
            x = (float(prefill_work[0]), float(prefill_work[1]), float(prefill_work[2]))
        else:
            x = (1.0, float(max(prompt_tokens - cached_tokens, 0)), float(cached_tokens))
        out.append(Sample("prefill", x, (end - start) * 1e3))
    d_start, d_end = timeline.get("decode.prefill_start"), timeline.get("decode.prefill_end")
    if prefill_leg == "decode" and d_start is not None and d_end is not None and d_end >= d_start:
        out.append(Sample("local", (1.0, float(max(prompt_tokens - cached_tokens, 0))), (d_end - d_start) * 1e3))
    got = timeline.get("decode.kv_received")
    ready = timeline.get("decode.registration_sent", timeline.get("decode.read_posted"))
    if prefill_leg != "decode" and moved_blocks > 0 and end is not None and got is not None:
        begin = max(end, ready) if ready is not None else end
        if got >= begin:
            out.append(Sample("handoff", (1.0, float(moved_blocks)), (got - begin) * 1e3))
    first, last = timeline.get("decode.first_token"), timeline.get("decode.finished")
    if output_tokens > 1 and first is not None and last is not None and last > first:
        ms = (last - first) * 1e3 / (output_tokens - 1)
        if decode_work and decode_work[0] > 0:
            steps, seqs, context, prefill_tokens = decode_work
            if prefill_tokens:  # its steps also prefilled a prompt on D: not the batch's cost
                return out
            batch, kctx = seqs / steps, context / steps / 1000.0
        else:
            batch = max(decode_batch, 1.0)
            kctx = batch * (prompt_tokens + output_tokens / 2.0) / 1000.0
        out.append(Sample("step", (1.0, batch, kctx), ms))
    return out

"""Request state inside a scheduler, and the pure batch builder and step tally.

No sockets, no clock reads: the scheduler core passes ``now`` in.
"""
from __future__ import annotations

import enum
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pushkv import messages as m
from pushkv.config import Role
from pushkv.kinds import FinishReason, Rendezvous, StreamSent
from pushkv.kv.layout import blocks_for


class State(enum.Enum):
    GRAMMAR = "grammar"  # structured output: held (not queued) until its grammar's compile ends off the loop
    WAITING = "waiting"  # queued for blocks
    PREFILL = "prefill"  # blocks held, prefill to run
    SENDING = "sending"  # P: KV handed to the writers
    AWAIT_KV = "await_kv"  # D: blocks registered / READ posted, waiting for the KV
    VERIFY = "verify"  # D: the KV is in; the workers check it against P's checksums (--kv-verify)
    RUNNING = "running"  # decoding
    DONE = "done"


@dataclass
class KVTally:
    """One request's KV transfer summed over the writer ranks that moved it."""

    nbytes: int = 0
    num_descs: int = 0
    transfer_s: float = 0.0  # the slowest rank's posted -> done
    parts: int = 0  # streamed part WRITEs (all ranks)
    stream: StreamSent = ""  # what P's writers say of the stream (KVSent.stream)

    def add(self, nbytes: int, num_descs: int, transfer_s: float) -> None:
        self.nbytes += nbytes
        self.num_descs += num_descs
        self.transfer_s = max(self.transfer_s, transfer_s)


@dataclass
class Request:
    transfer_id: str
    generation: int
    leg: Role
    prompt: tuple[int, ...]
    max_tokens: int
    identity: bytes  # router socket identity
    stop_ids: frozenset = frozenset()
    source: Optional[m.PrefillSource] = None
    pull: Optional[m.PullParams] = None
    seq_id: int = 0
    state: State = State.WAITING
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    in_step: bool = False
    aborted: str = ""  # reason, when aborted while a step or a transfer is outstanding
    answers: dict[int, m.Msg] = field(default_factory=dict)  # writer rank -> its KVSent / KVReceived / KVFailed
    timeline: dict[str, float] = field(default_factory=dict)
    kv: KVTally = field(default_factory=lambda: KVTally())
    rendezvous: Rendezvous = ""  # P, push: which half arrived first (from the writers' KVSent)
    sampling: Optional[m.SamplingParams] = None  # None: greedy
    late: bool = False  # P, push deployment: hold the KV and answer with pull parameters
    # what the steps that ran it did (reported to the router's cost model): see messages
    prefill_work: list = field(default_factory=lambda: [0, 0, 0])  # prefill: steps, tokens computed, context
    decode_work: list = field(default_factory=lambda: [0, 0, 0, 0])  # steps, seqs, context, prefill tokens
    prefill_here: bool = False  # D: no KV comes; D prefills the prompt itself (conditional disaggregation)
    reserved_at: float = 0.0  # D: monotonic time its blocks were reserved
    queued_at: float = 0.0  # monotonic time it arrived here (the instance's metrics measure from it)
    last_token_at: float = 0.0  # monotonic time this instance produced its latest token; 0 = none yet
    admitted_at: float = 0.0  # monotonic time its blocks were allocated here; 0 = not yet
    first_at: float = 0.0  # monotonic time of this instance's first token for it; 0 = none yet
    counted: bool = False  # its end is in vllm:request_success_total (once: P's pull leg ends before its KV leaves)
    reserved_block_s: float = 0.0  # D: blocks x seconds from reservation until the KV arrived
    reserved_blocks: int = 0  # D: the blocks reserved for the KV (its table grows later, as the output needs)
    prefilled: int = 0  # prompt tokens whose KV is in the pool (chunked prefill: grows chunk by chunk)
    streamed: bool = False  # P, streaming push: a chunk's blocks went to the writers before prefill ended
    cached: int = 0  # prompt tokens found in the prefix cache at admission (their KV is not computed again)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks of prompt + output
    indexed: int = 0  # leading blocks offered to the prefix cache so far
    # a /reset_prefix_cache forgot the blocks it had indexed while it held them: its later blocks chain from a head
    # no request can find, so it indexes none (a readmission recomputes from a chain head and indexes again)
    unchained: bool = False
    checksums: Optional[m.KVChecksums] = None  # --kv-verify: P's sums of the KV (P: computed; D: to check)
    verified: dict[int, m.KVVerified] = field(default_factory=dict)  # D: worker rank -> its verdict
    verify_at: float = 0.0  # D, --kv-verify: monotonic time the workers were asked (its deadline runs from it)
    first_out: bool = False  # D, --kv-verify: P's first token went out before the verdict (it gates the first step)
    # prompt logprobs, where the prompt is computed here: each chunk's as its step answered, then joined
    prompt_parts: list[m.PromptLogprobs] = field(default_factory=list)
    prompt_logprobs: Optional[m.PromptLogprobs] = None
    cache_salt: str = ""  # vLLM's: its prompt's block hashes chain from this salt's root (prefix.py)
    lora: str = ""  # the LoRA adapter it runs through ("": the base model); its hashes chain from the name's root
    lora_slot: int = 0  # ... the workers' slot of it (SeqWork.lora)
    lora_id: int = 0  # ... the id of its weights when it came (lora_table: its chain's root, KV events' lora_id)
    grammar: Any = None  # structured output: its grammar.Matcher, following the output
    structured: Optional[m.Structured] = None  # structured output: the spec its grammar is compiled from
    # repetition_penalty's distinct ids of the prompt and output, packed, kept as the output grows (seen_ids)
    _seen: Optional[array] = field(default=None, repr=False)
    _seen_set: set = field(default_factory=set, repr=False)
    _seen_out: int = 0
    # the order it last began to run here (vLLM's running order: a step's decodes go in it, the last is preempted
    # first): its admission, or on D its KV's arrival
    admit_seq: int = 0
    preemptions: int = 0  # times its blocks were taken back (it computes its prompt and output again)
    # after a preemption with output: the tokens to prefill again (prompt + output so far); (): its prompt
    recompute: tuple[int, ...] = ()
    stop_strings: bool = False  # the router searches its text for stop strings (Generate.stop_strings)

    @property
    def key(self) -> tuple[str, int]:
        return (self.transfer_id, self.generation)

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """The tokens its prefill computes: the prompt, or after a preemption the prompt and output so far (its last
        chunk samples output token ``len(output)``, as a decode step would)."""
        return self.recompute or self.prompt

    def blocks_needed(self, block_size: int) -> int:
        """All blocks the request may ever hold (a pool smaller than that is refused: alone, it always finishes)."""
        return blocks_needed(self.leg, len(self.prompt), self.max_tokens, block_size)

    def blocks_to_admit(self, block_size: int) -> int:
        """The blocks taken at admission: P's whole prompt; elsewhere the prefill's tokens and the next token's
        slot (``grows`` adds the rest a block at a time as the output needs them)."""
        if self.leg == "prefill":
            return blocks_for(len(self.prompt), block_size)
        return blocks_for(min(len(self.prefill_ids) + 1, len(self.prompt) + self.max_tokens), block_size)

    def blocks_short(self, block_size: int, n: int = 1) -> int:
        """The blocks it lacks for a step that computes ``n`` of its tokens: a decode stores output[-1]'s KV, a
        prefill chunk the ``n`` tokens after ``prefilled`` (vLLM's ``allocate_slots`` for the tokens it schedules)."""
        end = self.prefilled + n if self.state == State.PREFILL else len(self.prompt) + len(self.output)
        return blocks_for(end, block_size) - len(self.blocks)

    @property
    def score_prompt(self) -> int:
        """The top N of the prompt logprobs this instance computes for the request (-1: none): asked,
        and the prompt is computed here (P, a local instance, a D that prefills it itself)."""
        p = self.sampling
        if p is None or p.prompt_logprobs < 0 or (self.leg == "decode" and not self.prefill_here) or self.recompute:
            return -1  # (a recompute's: they went out with the first token)
        return p.prompt_logprobs

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is (or will be after the current step) in the pool."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    def sample_fields(self) -> dict:
        """What the worker needs to draw output token len(output): SeqWork's sampling fields."""
        p = self.sampling
        if p is None:  # greedy; structured output still masks the draw
            return {"token_mask": self.grammar.mask(self.output)} if self.grammar is not None else {}
        history = tuple(self.output) if (p.presence_penalty or p.frequency_penalty) else ()
        seen = self.seen_ids() if p.repetition_penalty != 1.0 else b""
        stops = self.stop_ids if len(self.output) < p.min_tokens else frozenset()
        suppress = stops | bad_word_bans(p.bad_words, self.output) if p.bad_words else stops
        if p.allowed_token_ids and suppress.issuperset(p.allowed_token_ids):
            # a step always has a token to draw: bans that would leave no allowed id are lifted for it (the
            # router refuses the requests where that is so from the start; only a multi-id word gets here)
            suppress = stops if not stops.issuperset(p.allowed_token_ids) else frozenset()
        mask = self.grammar.mask(self.output) if self.grammar is not None else b""
        if mask and suppress:  # the grammar's tokens left to draw are never all taken away (min_tokens, bad words)
            from pushkv.scheduler.grammar import allowed_ids

            if suppress.issuperset(allowed_ids(mask, 1 << 31) or ()):
                suppress = frozenset()
        return {"sampling": p, "output_index": len(self.output), "history": history, "seen": seen,
                "suppress": tuple(sorted(suppress)), "token_mask": mask}

    def seen_ids(self) -> bytes:
        """The distinct ids of the prompt and of the output so far (repetition_penalty's), packed little-endian
        int32 (``SeqWork.seen``): the prompt's, sorted, once; then each output id as it first comes."""
        if self._seen is None:
            self._seen_set = set(self.prompt)
            self._seen = array("i", sorted(self._seen_set))
        for t in self.output[self._seen_out:]:
            if t not in self._seen_set:
                self._seen_set.add(t)
                self._seen.append(t)
        self._seen_out = len(self.output)
        if sys.byteorder != "little":
            swapped = array("i", self._seen)
            swapped.byteswap()
            return swapped.tobytes()
        return self._seen.tobytes()

    def note_answer(self, msg: m.Msg, rank: int) -> None:
        """Writer rank ``rank`` answered the transfer: keep its answer (a failure is never
        overwritten) and add what it moved and its stages (the first rank's win) to ours."""
        if not isinstance(self.answers.get(rank), m.KVFailed):
            self.answers[rank] = msg
        for stage, t in getattr(msg, "timeline", ()):
            self.timeline.setdefault(stage, t)
        if isinstance(msg, m.KVSent) and msg.rendezvous:
            self.rendezvous = msg.rendezvous
        if isinstance(msg, (m.KVSent, m.KVReceived)) and msg.nbytes:
            self.kv.add(msg.nbytes, msg.num_descs, msg.transfer_s)
        if isinstance(msg, m.KVSent):
            self.kv.parts += msg.parts
            self.kv.stream = self.kv.stream or msg.stream

    def kv_stats(self, describe: Callable[[StreamSent], str] = str) -> Optional[m.KVTransferStats]:
        """What moved the request's KV, for its last answer (None: nothing moved); ``describe``
        says the stream as the stats show it (P: ``TransferPlan.describe``, which names a fallback's why)."""
        kv = self.kv
        if self.leg == "local" or not kv.nbytes:
            return None
        rendezvous = self.rendezvous or ("pull" if self.pull is not None else "")
        reserved = self.reserved_blocks if self.reserved_block_s else 0
        return m.KVTransferStats(kv.nbytes, kv.num_descs, kv.transfer_s, rendezvous, self.reserved_block_s,
                                 reserved, kv.parts, describe(kv.stream))

    def sorted_timeline(self) -> tuple[tuple[str, float], ...]:
        return tuple(sorted(self.timeline.items(), key=lambda kv: kv[1]))

    def finished(self) -> Optional[FinishReason]:
        if self.output and self.output[-1] in self.stop_ids:
            return "stop"
        if self.grammar is not None:  # structured output: the grammar is complete (it took its stop token)
            self.grammar.advance(self.output)
            if self.grammar.terminated:
                return "stop"
        if len(self.output) >= self.max_tokens:
            return "length"
        return None


def bad_word_bans(words: tuple[tuple[int, ...], ...], output: list[int]) -> frozenset:
    """vLLM's bad_words: the ids that would complete one of ``words`` after ``output``, the tokens generated so
    far: each word's last id, where the output ends with the ids before it (a one-id word's, always)."""
    n = len(output)
    return frozenset(w[-1] for w in words
                     if len(w) - 1 <= n and (len(w) == 1 or output[n - len(w) + 1:] == list(w[:-1])))


def blocks_needed(leg: str, prompt_len: int, max_tokens: int, block_size: int) -> int:
    """A leg's blocks: its prompt's on P, the prompt's plus ``max_tokens`` elsewhere."""
    if leg == "prefill":
        return blocks_for(prompt_len, block_size)
    return blocks_for(prompt_len + max_tokens, block_size)


def decodes_taken(running: list[Request], max_num_seqs: int, max_loras: int = 0,
                  max_tokens: int = sys.maxsize) -> tuple[list[Request], set[int]]:
    """The decoding requests a step takes (``plan_step``'s first part, and the ones ``preempt.grow`` gives their next
    block: vLLM allocates only for the requests it schedules), in the order given, and the LoRA slots they hold: at
    most ``max_num_seqs``, and with ``max_loras`` sequences of at most that many adapters (the base model's not
    counted); where the running requests name more adapters than that, the ones that have waited longest for a token
    go first, so none starves. Each is one token of the step's ``max_tokens`` (--max-batch-tokens, vLLM's
    --max-num-batched-tokens: its token budget counts the running decodes first)."""
    taken: list[Request] = []
    loras: set[int] = set()
    if max_loras > 0 and len({r.lora_slot for r in running if r.lora_slot}) > max_loras:
        running = sorted(running, key=lambda r: r.last_token_at)
    for r in running:
        if len(taken) >= min(max_num_seqs, max_tokens):
            break
        if r.lora_slot and max_loras > 0 and r.lora_slot not in loras:
            if len(loras) >= max_loras:
                continue
            loras.add(r.lora_slot)
        taken.append(r)
    return taken, loras


def chunk_tokens(left: int, budget_left: int, prefill_chunk: int, alone: bool) -> int:
    """The tokens of a prefill with ``left`` tokens to compute that a step takes with ``budget_left`` of its token
    budget left: at most ``prefill_chunk`` (0: the rest whole) and the budget left (0: none, it waits, as vLLM's
    ``token_budget``). Unchunked, the rest runs whole only where it fits the budget left, or ``alone`` (nothing else in
    the step: a prompt longer than the whole budget still runs; vLLM refuses that configuration)."""
    if prefill_chunk > 0:
        return max(0, min(left, prefill_chunk, budget_left))
    return left if left <= budget_left or alone else 0


def plan_step(prefills: list[Request], running: list[Request], max_num_seqs: int, max_batch_tokens: int,
              prefill_chunk: int = 0, max_loras: int = 0) -> list[tuple[Request, int]]:
    """What one continuous-batching step computes, as (request, tokens): the running decodes first, one token each,
    then the prefills in the order given (running order) while the token budget lasts (``chunk_tokens``). Every
    token counts against ``max_batch_tokens``, the decodes' too (vLLM's token budget): decodes past it wait for a
    later step, and a prefill gets only what they left (none where they took it all). ``build_batch`` makes the
    workers' SeqWorks of it; ``preempt.grow`` gives each the blocks its tokens need first."""
    decodes, loras = decodes_taken(running, max_num_seqs, max_loras, max_batch_tokens)
    plan: list[tuple[Request, int]] = [(r, 1) for r in decodes]
    tokens = len(plan)
    for r in prefills:
        if len(plan) >= max_num_seqs or tokens >= max_batch_tokens:
            break
        if r.lora_slot and max_loras > 0 and r.lora_slot not in loras and len(loras) >= max_loras:
            continue
        n = chunk_tokens(len(r.prefill_ids) - r.prefilled, max_batch_tokens - tokens, prefill_chunk, not plan)
        if n <= 0:
            break
        if r.lora_slot and max_loras > 0:
            loras.add(r.lora_slot)
        plan.append((r, n))
        tokens += n
    return plan


def build_batch(prefills: list[Request], running: list[Request], max_num_seqs: int,
                max_batch_tokens: int, prefill_chunk: int = 0, max_loras: int = 0) -> list[tuple[Request, m.SeqWork]]:
    """One continuous-batching step (``plan_step``): every running decode the budget takes, then prefills that fit
    (a prefill is of ``Request.prefill_ids``: the prompt, or after a preemption the prompt and output so far).

    Decodes go first so that admitting prompts never stalls generation; they count against the token budget, as
    vLLM's. Without chunking (``prefill_chunk`` 0) a prompt runs whole, where it fits the budget the decodes left
    (or alone in the step, even past the budget). With chunking, a prompt runs from where its last chunk ended, at
    most ``prefill_chunk`` tokens a step and no more than the budget left after the decodes; only its last chunk
    samples. A prompt that asked prompt logprobs has each chunk scored (``SeqWork.score_prompt``), with the prompt's
    token after the chunk where there is one.
    With ``max_loras`` (vLLM's --max-loras), a step holds sequences of at most that many LoRA adapters (the base
    model's not counted): a request of another adapter waits for a later step, and where the running requests name
    more adapters than that, the ones that have waited longest for a token go first, so none starves.
    """
    return works_of(plan_step(prefills, running, max_num_seqs, max_batch_tokens, prefill_chunk, max_loras))


def works_of(plan: list[tuple[Request, int]]) -> list[tuple[Request, m.SeqWork]]:
    """The workers' SeqWork of each (request, tokens) of a ``plan_step``."""
    batch: list[tuple[Request, m.SeqWork]] = []
    for r, n in plan:
        lora = r.lora_slot
        if r.state == State.RUNNING:  # a decode: output[-1]'s KV, sampling output token len(output)
            pos = len(r.prompt) + len(r.output) - 1
            batch.append((r, m.SeqWork(r.seq_id, (r.output[-1],), pos, tuple(r.blocks), **r.sample_fields(),
                                       lora=lora)))
            continue
        seq = r.prefill_ids
        start = r.prefilled
        last = start + n == len(seq)
        fields = r.sample_fields() if last else {"sample": False, "rope_len": len(seq)}
        if r.score_prompt >= 0:
            fields.update(score_prompt=r.score_prompt, next_prompt_token=-1 if last else r.prompt[start + n])
        batch.append((r, m.SeqWork(r.seq_id, seq[start:start + n], start, tuple(r.blocks), **fields, lora=lora)))
    return batch


def count_work(batch: list[tuple[Request, m.SeqWork]]) -> None:
    """What a step computes, added to each of its requests (the router fits its costs on it)."""
    pre_tokens = pre_ctx = seqs = ctx = 0
    for r, w in batch:
        if r.state == State.PREFILL:
            pre_tokens += len(w.token_ids)
            pre_ctx += w.start_pos
        else:
            seqs += 1
            ctx += w.start_pos + 1
    for r, _w in batch:
        if r.state == State.PREFILL:
            r.prefill_work[0] += 1
            r.prefill_work[1] += pre_tokens
            r.prefill_work[2] += pre_ctx
        else:
            dw = r.decode_work
            dw[0] += 1
            dw[1] += seqs
            dw[2] += ctx
            dw[3] += pre_tokens


def failures_of(answers: dict[int, m.Msg]) -> tuple[list[m.KVFailed], str]:
    """The writer ranks' failures, and the lost peer any of them names ("" if none)."""
    failures = [a for a in answers.values() if isinstance(a, m.KVFailed)]
    return failures, next((a.lost for a in failures if a.lost), "")

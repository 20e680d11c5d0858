"""Every wire type of pushkv, and nothing else.

One tagged union per channel. Commands are imperatives, events past tense,
failures ``...Failed`` with a reason. Request-scoped messages carry
``transfer_id`` (and ``generation``) first. New fields are appended with
defaults, never reordered.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

from pushkv.kinds import FinishReason, PoolKind, Rendezvous, Role, StreamSent  # Literals: closed sets


class Msg(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """Base of every wire message (tag = class name). Each subclass says ``frozen=True`` again:
    msgspec inherits it at run time, but mypy's dataclass_transform reads a subclass without it
    as mutable (and refuses it under a frozen base)."""


# ---------------------------------------------------------------------------
# Shared value types (not messages on their own)
# ---------------------------------------------------------------------------
class KVLayoutDesc(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Physical layout of one rank's KV pool (see pushkv.kv.layout.KVLayout)."""

    num_blocks: int
    num_layers: int
    block_size: int
    kv_heads: int  # heads held by this rank (local)
    head_start: int  # global index of the first local head
    total_kv_heads: int
    head_dim: int
    dtype_bytes: int
    window_layers: tuple[int, ...] = ()  # sliding-window layer indices
    window: int = 0  # sliding window (tokens), 0 = none
    kv_planes: int = 2  # per (layer, head): K and V; 1 = one latent (MLA-style)
    sub_block: int = 0  # tokens per physical sub-block (divides block_size); 0 = block_size
    head_group: int = 0  # local heads per pool region (divides kv_heads); 0 = all of them
    layer_split: int = 0  # layer-streamed push: the layers cut into this many groups (regions); 0/1 = one


class PoolHandle(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How a worker maps the pool its writer owns."""

    kind: PoolKind
    name: str  # shm: the segment's path; cuda_ipc: ""
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    ipc: bytes = b""  # cuda_ipc: torch's CUDA IPC handle fields of the pool's storage, msgpack-encoded


class PrefillSource(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Where a decode instance finds the prefill instance's writers."""

    engine_id: str
    tp: int
    handshake: tuple[str, ...]  # one ZMQ endpoint per P writer rank


class KVChecksums(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """P's checksums of a request's KV as stored (``--kv-verify``; ``pushkv/kv/checksum.py``).

    Keyed by logical content, so they mean the same on every layout: a unit is
    ``unit_tokens`` tokens of the prompt (P's block size: whole sub-blocks on both sides),
    a row is one global KV head, and a row holds one sum per (layer group, unit of
    ``units``), group-major; a unit a group does not move (before a sliding window) is 0.
    ``sums`` holds the rows packed, as little-endian signed 64-bit integers: an 8k prompt's
    every unit is 16k sums, which as bytes cost a copy on each hop, not 16k Python ints.
    """

    unit_tokens: int
    num_tokens: int
    units: tuple[int, ...]  # unit indices checked: all of them (full) or a sample
    heads: tuple[int, ...]  # global KV head of each row
    sums: bytes  # per head in ``heads`` order: len(layer groups) * len(units) sums, '<i8' each


class PullParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What P returns in pull mode, relayed by the router to D."""

    source: PrefillSource
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    lease_deadline: float  # P's monotonic clock; informative only
    checksums: Optional[KVChecksums] = None  # --kv-verify: what D checks its blocks against after the READ


class SamplingParams(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """How a request's tokens are drawn (pushkv.model.sampling). The defaults are greedy.

    Defined by the request alone, so P (first token) and D (the rest) draw as one
    process would: the randomness of output token i is a function of (seed, i).
    """

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    seed: int = 0  # 64-bit; the router picks one for unseeded requests
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int = -1  # -1: none; 0: the sampled token's; k: also the k most likely
    min_tokens: int = 0  # stop ids are suppressed until this many tokens are out
    # the prompt's own log-probabilities, computed where the prompt is (P, or the instance that prefills
    # it): -1: none; 0: each prompt token's; k: also the k most likely at each position
    prompt_logprobs: int = -1
    # vLLM's allowed_token_ids: only these ids may be drawn (every other logit -inf); empty: no restriction
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token id sequences (each word as the router's tokenizer writes it, with and without
    # a leading space): a word's last id is banned where the output so far ends with the ids before it
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's (and transformers'): each id of the prompt and the output so far has its logit divided by this where
    # positive and multiplied where not, before the presence and frequency penalties; 1: off
    repetition_penalty: float = 1.0


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One sampled token's log-probability and the most likely alternatives (raw model distribution)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """log p(prompt token i | the tokens before it) for the ``count`` positions from ``start`` on
    (the first prompt token has none: ``start`` >= 1), from the raw distribution in float32, with
    the token's rank (how many ids are at least as likely, itself included: vLLM's) and the ``top``
    most likely ids at each position. Packed little-endian, as ``KVChecksums`` is: a long prompt's
    every position is ``2 + 2 * top`` numbers, which as bytes cost a copy on each hop, not
    Python objects (``pushkv/prompt_logprobs.py`` reads and joins them)."""

    start: int
    count: int
    top: int
    logprobs: bytes = b""  # '<f4' per position
    ranks: bytes = b""  # '<i4' per position
    top_ids: bytes = b""  # '<i4' per position x top, most likely first
    top_logprobs: bytes = b""  # '<f4' per position x top


class SeqWork(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One sequence's share of a forward step."""

    seq_id: int
    token_ids: tuple[int, ...]  # new tokens to run
    start_pos: int  # position of token_ids[0]
    block_table: tuple[int, ...]
    sample: bool = True
    sampling: Optional[SamplingParams] = None  # None: greedy
    output_index: int = 0  # which output token this step samples (0 = the first)
    history: tuple[int, ...] = ()  # output so far, when a penalty needs it
    # repetition_penalty: the distinct ids of the prompt and of the output so far, packed '<i4' (a long prompt's
    # thousands of ids go as one copy, not as Python ints to build and read each step)
    seen: bytes = b""
    suppress: tuple[int, ...] = ()  # ids that may not be sampled now (stop ids before min_tokens)
    checksum: Literal["", "sample", "full"] = ""  # P, the prompt's last chunk: answer the KV's checksums (--kv-verify)
    # dynamic RoPE: the sequence length whose frequencies these tokens take (a prompt's chunk: the
    # whole prompt's, as transformers' one prefill takes them); 0: start_pos + len(token_ids)
    rope_len: int = 0
    # a prompt's chunk whose request asked prompt logprobs: the top N to give at each position it
    # scores (each scores the token after it); -1: none, the default, and no cost
    score_prompt: int = -1
    # the prompt's token after this chunk, which its last position scores; -1: the chunk ends the
    # prompt (its last position's logits give the first output token instead)
    next_prompt_token: int = -1
    # structured output: the tokens this step may draw, bit t of little-endian int32 word t // 32 (xgrammar's
    # bitmask); b"": no mask
    token_mask: bytes = b""
    lora: int = 0  # the LoRA adapter's slot this sequence runs through (config.LoraConfig.slot); 0: none


class KVTransferStats(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request's KV transfer as the side that posted it measured it (for metrics)."""

    nbytes: int
    num_descs: int
    transfer_s: float  # posted -> done, slowest rank
    rendezvous: Rendezvous = ""  # push: which half came first; pull: "pull"
    # D: its blocks x seconds from their reservation until the KV had arrived (push's cost:
    # D memory held while P computes), and how many blocks that was
    reserved_block_s: float = 0.0
    reserved_blocks: int = 0
    parts: int = 0  # streaming push: WRITEs posted while P still computed (before the last one)
    stream: str = ""  # streaming push: "layer" or "chunk"; "fallback: <why>"; "" when not streamed


class Structured(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Structured output (vLLM's structured_outputs, OpenAI's response_format): the output is held to a grammar,
    each step's tokens masked to those that keep it valid (pushkv/structured.py), on P and on D alike."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    # json: the schema (JSON text); regex; choice: a JSON list of strings; grammar: EBNF; structural_tag: xgrammar's
    # structural tag (JSON text: {"format": ...}, or the older {"structures": [...], "triggers": [...]})
    spec: str = ""
    any_whitespace: bool = True  # JSON: any whitespace between tokens (vLLM's default; false: compact)
    # with a reasoning parser: the ids that end the reasoning ("</think>"); the grammar holds what follows them,
    # from the start where the prompt already has them (Qwen3 with enable_thinking false), as vLLM's
    after: tuple[int, ...] = ()


# ---------------------------------------------------------------------------
# Channel: router <-> scheduler
# ---------------------------------------------------------------------------
class Generate(Msg, frozen=True):
    transfer_id: str
    generation: int
    leg: Role
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    source: Optional[PrefillSource] = None  # decode leg: where the KV comes from
    pull: Optional[PullParams] = None  # decode leg in pull mode
    arrival: float = 0.0  # router's wall clock (time.time()) for timelines
    sampling: Optional[SamplingParams] = None  # None: greedy
    # prefill leg of a push deployment falling back to late allocation: hold the KV and answer
    # PrefillFinished.pull at once, as in pull mode; the router places D's leg afterwards
    late: bool = False
    # decode leg with no source: D prefills the prompt itself, as a local instance (conditional
    # disaggregation: nothing moves)
    prefill_here: bool = False
    # vLLM's cache_salt: the prompt's cached blocks are shared only with requests of the same salt
    cache_salt: str = ""
    structured: Optional[Structured] = None  # the output held to a grammar
    lora: str = ""  # the LoRA adapter the request names as its model (vLLM's --lora-modules); "": the base model
    # a token leg whose text the router searches for stop strings: should it end by length, its end is counted once
    # the router says how the client's choice ended (ChoiceEnded: a stop string may match on its last token)
    stop_strings: bool = False


class Abort(Msg, frozen=True):
    transfer_id: str
    generation: int
    reason: str = "aborted by client"
    # the request is complete at the router and this token leg ends with that reason (a stop string the router
    # matched: "stop"), counted as vLLM counts a stop string its frontend matched. "": an abort (the client gone,
    # /v1/abort, the deadline, a failure elsewhere), which vLLM counts nowhere
    finish: FinishReason = ""


class ChoiceEnded(Msg, frozen=True):
    """How the client's choice ended, for a token leg that ended by length while the router searched its text for
    stop strings (``Generate.stop_strings``): "stop" where one matched on its last token, which vLLM's frontend counts
    as stop (its detokenizer's match overrides the engine's length); its instance counts the leg's end so."""

    transfer_id: str
    generation: int
    finish: FinishReason


class GetStats(Msg, frozen=True):
    pass


class ResetPrefixCache(Msg, frozen=True):
    """Forget every cached prefix (``POST /reset_prefix_cache``); answered with ``Stats``, as ``GetStats`` is."""


class TokensGenerated(Msg, frozen=True):
    transfer_id: str
    generation: int
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason = ""
    num_prompt_tokens: int = 0
    timeline: tuple[tuple[str, float], ...] = ()  # (stage, wall time) on finish
    kv: Optional[KVTransferStats] = None  # D, on finish: the transfer D measured (pull: its READ)
    logprobs: tuple[TokenLogprob, ...] = ()  # when asked: one per token id (D omits P's first token's)
    cached_tokens: int = 0  # on finish, and with a local instance's first token: prompt tokens this instance took
    # from its prefix cache
    # on finish, summed over the steps that decoded it (the router's cost model): steps, sequences
    # decoded in them, their context tokens, and prompt tokens other requests prefilled in them
    decode_steps: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    decode_prefill_tokens: int = 0
    # the instance that prefilled the prompt, with its first token, when the request asked
    # (local, D prefilling it; P's own TokensGenerated in push and pull)
    prompt_logprobs: Optional[PromptLogprobs] = None


class PrefillFinished(Msg, frozen=True):
    """P's leg is done (push: KV written; pull: KV held under lease)."""

    transfer_id: str
    generation: int
    first_token: int
    pull: Optional[PullParams] = None
    timeline: tuple[tuple[str, float], ...] = ()
    kv: Optional[KVTransferStats] = None  # push: P's WRITE (bytes, descriptors, time, rendezvous order)
    cached_tokens: int = 0  # prompt tokens P took from its prefix cache (not computed again)
    # summed over the steps that computed its prompt (the router's cost model): the steps, the
    # prompt tokens every request of those steps computed, and the cached context they attended
    prefill_steps: int = 0
    prefill_step_tokens: int = 0
    prefill_step_context: int = 0


class RequestFailed(Msg, frozen=True):
    transfer_id: str
    generation: int
    reason: str
    status: int = 500  # HTTP status the router should answer with


class Stats(Msg, frozen=True):
    engine_id: str
    role: Role
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    counters: dict[str, int] = {}
    cached_blocks: int = 0  # blocks in the prefix cache's index (held by requests or evictable)


class PeerLost(Msg, frozen=True):
    """An instance of the other role is gone (its lease lapsed, it was withdrawn) or came back
    as a new incarnation: the router tells every scheduler, which tells its writers. Across
    hosts this is the only peer-death news (no shared supervisor): writers end their transfers
    with it at once (instead of at their deadlines) and D forgets its NIXL metadata, so the
    next request with it handshakes afresh."""

    engine_id: str
    role: Role
    reason: str


class RouterEpoch(Msg, frozen=True):
    """The router's first message on each scheduler link: its epoch, the wall clock's ns at its
    start, and ``router``, where it serves (its address and port, or socket path). A scheduler that
    hears a newer epoch from a router at that place aborts every request another connection of that
    place sent (the router before a restart: nobody will read those tokens) and frees their blocks;
    a router elsewhere (a second replica, a rolling update's new pod beside the old one, which is
    still draining) is left alone; an older epoch is counted and ignored. A connection that has not
    said its place is no orphan of any. ``again``: said again on a new connection (the scheduler may
    have restarted); the scheduler logs it and treats it as any epoch."""

    epoch: int
    router: str = ""
    again: bool = False


class LoadLora(Msg, frozen=True):
    """Serve one more LoRA adapter from now on (vLLM's ``POST /v1/load_lora_adapter``): the router asks each
    scheduler, which gives it a slot and asks each worker rank to load it there. ``replace``: a served adapter of
    that name takes these weights (vLLM's ``load_inplace``); its requests running keep the old ones."""

    name: str
    path: str  # its PEFT directory, on the instance's host
    slot: int = 0  # scheduler -> worker: the slot it goes in
    replace: bool = False


class UnloadLora(Msg, frozen=True):
    """Stop serving a LoRA adapter (vLLM's ``POST /v1/unload_lora_adapter``): new requests naming it are refused,
    its requests running end as they would; a worker frees the slot once none holds it (scheduler -> worker)."""

    name: str
    slot: int = 0  # scheduler -> worker


class LoraChanged(Msg, frozen=True):
    """A worker rank's answer to ``LoadLora`` (for its slot; an unload it does not answer), and a scheduler's to
    ``LoadLora`` (once every rank answered) or ``UnloadLora``, with the adapters it serves after it. ``error`` "":
    done."""

    name: str
    error: str = ""
    slot: int = 0
    adapters: tuple[str, ...] = ()


RouterToScheduler = Union[Generate, Abort, GetStats, PeerLost, RouterEpoch, ResetPrefixCache, LoadLora, UnloadLora,
                          ChoiceEnded]
SchedulerToRouter = Union[TokensGenerated, PrefillFinished, RequestFailed, Stats, LoraChanged]


# ---------------------------------------------------------------------------
# Channel: scheduler <-> worker
# ---------------------------------------------------------------------------
class ExecuteStep(Msg, frozen=True):
    step_id: int
    seqs: tuple[SeqWork, ...]
    # layer-streamed push (P): the streaming prompts this step computes, each with the tokens it
    # will hold after the step; the worker tells its writer as each layer group is stored
    stream: tuple["StreamKV", ...] = ()


class StepDone(Msg, frozen=True):
    step_id: int
    sampled: tuple[int, ...]  # one per seq with sample=True, in order
    compute_s: float = 0.0
    logprobs: tuple[Optional[TokenLogprob], ...] = ()  # aligned with sampled when any seq asked
    # one per seq with a checksum asked, in order: this rank's heads of the KV it stored
    checksums: tuple[KVChecksums, ...] = ()
    # one per seq with score_prompt >= 0, in order (rank 0's: every rank computes the same logits)
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


class StepFailed(Msg, frozen=True):
    step_id: int
    reason: str


class VerifyKV(Msg, frozen=True):
    """D, before a request's first decode step: recompute the checksums over the blocks the KV
    landed in and compare them with P's (this rank's heads)."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    checksums: KVChecksums


class KVVerified(Msg, frozen=True):
    """A worker rank's answer to ``VerifyKV``: ``reason`` is "" when every checked sum matched."""

    transfer_id: str
    generation: int
    reason: str = ""
    checked: int = 0  # sums compared on this rank
    compute_s: float = 0.0


SchedulerToWorker = Union[ExecuteStep, VerifyKV, LoadLora, UnloadLora]
WorkerToScheduler = Union[StepDone, StepFailed, KVVerified, LoraChanged]


class LayersStored(Msg, frozen=True):
    """P worker -> its writer (layer-streamed push): layer group ``group`` of step ``step_id``
    is in the pool (on CUDA: once ``event`` completes), so each entry's first ``num_tokens``
    tokens of that group may leave."""

    step_id: int
    group: int
    entries: tuple["StreamKV", ...]
    recorded: float = 0.0  # when the worker's forward passed the group's last store (wall clock)
    # on CUDA: the handle of an inter-process event recorded after the group's stores (the writer
    # waits for it: kv/layer_events.py); empty on the CPU, where the stores are done
    event: bytes = b""


WorkerToWriter = Union[LayersStored]


# ---------------------------------------------------------------------------
# Channel: scheduler <-> writer
# ---------------------------------------------------------------------------
class SendKV(Msg, frozen=True):
    """P: these finished blocks hold the request's KV; push them to D."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    checksums: Optional[KVChecksums] = None  # --kv-verify: sent to D with the WRITE's notification


class StreamKV(Msg, frozen=True):
    """P, streaming push: the prompt's first ``num_tokens`` tokens are in these blocks (a
    prefill chunk ended, more of the prompt is still computing). The writer WRITEs what is
    whole on both sides now; ``SendKV`` still follows at the end of prefill."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    num_tokens: int


class HoldKV(Msg, frozen=True):
    """P (pull): keep these blocks under a lease until D has read them."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    lease_s: float
    write: bool = False  # D registers after the relay and we WRITE (not: D READs under a lease)


class ExpectKV(Msg, frozen=True):
    """D (push): blocks are reserved; register them with P's writers."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    num_tokens: int
    source: PrefillSource
    deadline_s: float
    cached_tokens: int = 0  # the prompt's first tokens D holds already (prefix cache): not to be written


class ReadKV(Msg, frozen=True):
    """D (pull, background): READ P's blocks into ours."""

    transfer_id: str
    generation: int
    block_ids: tuple[int, ...]
    pull: PullParams
    deadline_s: float
    write: bool = False  # register with P now and let it WRITE (push's transfer, late allocation)
    cached_tokens: int = 0  # the prompt's first tokens D holds already (prefix cache): not to be moved


class CancelKV(Msg, frozen=True):
    transfer_id: str
    generation: int
    reason: str = "cancelled"


class KVSent(Msg, frozen=True):
    """P: the WRITE (push) or the remote READ (pull) finished; blocks may be freed."""

    transfer_id: str
    generation: int
    nbytes: int = 0
    num_descs: int = 0
    transfer_s: float = 0.0
    rendezvous: Rendezvous = ""  # which half came first (push), "pull", or "replica" (nothing to write)
    timeline: tuple[tuple[str, float], ...] = ()  # writer stages (wall time)
    parts: int = 0  # streaming push: WRITEs posted before prefill ended (the last WRITE not counted)
    stream: StreamSent = ""  # "layer" or "chunk"; "fallback": asked for but off (TransferPlan.fallback says why)


class KVReceived(Msg, frozen=True):
    transfer_id: str
    generation: int
    first_token: int
    nbytes: int = 0
    num_descs: int = 0
    transfer_s: float = 0.0
    timeline: tuple[tuple[str, float], ...] = ()  # writer stages (wall time)
    checksums: Optional[KVChecksums] = None  # push: P's, from its WriteDone (--kv-verify)


class KVFailed(Msg, frozen=True):
    """Either side: the transfer failed; free the blocks, fail the request."""

    transfer_id: str
    generation: int
    reason: str
    # set when the other role's instance died: the request's answer ("<role> instance failed: ..."),
    # the same the router gives when it learns of the death first
    lost: str = ""


class WriterStats(Msg, frozen=True):
    counters: dict[str, int] = {}


class RenewKV(Msg, frozen=True):
    """D (pull): this request still means to read P's blocks (queued here, or its READ in
    flight on this rank): renew P's lease on them with the producer ranks we read from."""

    transfer_id: str
    generation: int
    source: PrefillSource


SchedulerToWriter = Union[SendKV, HoldKV, ExpectKV, ReadKV, CancelKV, GetStats, PeerLost, StreamKV, RenewKV]
WriterToScheduler = Union[KVSent, KVReceived, KVFailed, WriterStats]


# ---------------------------------------------------------------------------
# Channel: writer <-> writer, carried as NIXL notifications
# ---------------------------------------------------------------------------
class Register(Msg, frozen=True):
    """D -> P: destination blocks for one request on one D rank."""

    transfer_id: str
    generation: int
    d_engine_id: str
    d_rank: int
    d_tp: int
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline: float = 0.0  # seconds from receipt
    # D's writer keeps its loop hot until this transfer's KV is here (writer_warm): it polls
    # NIXL without being told, so P skips the TransferStarting wake hint on its post path
    warm: bool = False
    # D's prefix cache holds the KV of the prompt's first cached_tokens tokens already (a whole
    # number of blocks on both sides): P WRITEs only the tokens from there on
    cached_tokens: int = 0


class WriteDone(Msg, frozen=True):
    """P -> D: this P rank's WRITE into the registered blocks completed."""

    transfer_id: str
    generation: int
    p_rank: int
    first_token: int
    nbytes: int = 0
    num_descs: int = 0
    checksums: Optional[KVChecksums] = None  # --kv-verify: P's sums of the KV this WRITE moved


class PartWritten(Msg, frozen=True):
    """P -> D (--staging pushkv): this P rank's part WRITE of a streamed transfer landed in the
    registered slots; its notification, which NIXL delivers after the part's data. D copies
    what every producer's part has landed into its blocks while later parts are on the wire."""

    transfer_id: str
    generation: int
    p_rank: int
    spans: tuple[tuple[int, int, int], ...]  # (layer group, -1: every group; first token; end token)


class WriteFailed(Msg, frozen=True):
    transfer_id: str
    generation: int
    p_rank: int
    reason: str


class ReadDone(Msg, frozen=True):
    """D -> P (pull): finished reading; P frees its leased blocks."""

    transfer_id: str
    generation: int
    d_rank: int


class CancelTransfer(Msg, frozen=True):
    """Either way: the other half was aborted; drop state and free blocks."""

    transfer_id: str
    generation: int
    reason: str


class RenewLease(Msg, frozen=True):
    """D -> P (pull): D rank ``d_rank`` still means to read; push the lease's deadline on
    (``protocol/lease.py``: now + lease_s, never past the cap lease_max_s)."""

    transfer_id: str
    generation: int
    d_rank: int


PeerNotif = Union[Register, WriteDone, WriteFailed, ReadDone, CancelTransfer, RenewLease, PartWritten]


# ---------------------------------------------------------------------------
# Channel: writer handshake (ZMQ DEALER/ROUTER, once per peer pair; the link then carries wake hints)
# ---------------------------------------------------------------------------
# The writers' handshake says which wire it speaks; a peer on another version is refused by name.
WIRE_VERSION = 4  # 3: KVChecksums.sums packed as bytes; 4: control on the handshake link (HandshakeMsg)


class Hello(Msg, frozen=True):
    engine_id: str
    rank: int
    tp: int
    agent_name: str
    agent_metadata: bytes
    pool_base: int
    layout: KVLayoutDesc
    device_id: int = 0  # GPU index of the pool (NIXL descriptors name it); 0 on CPU
    # a small registered buffer no request owns: a peer keeping the path warm WRITEs into it (0: none)
    sink_addr: int = 0
    sink_bytes: int = 0
    device_uuid: str = ""  # the pool's GPU ("" on the CPU): a peer on the same GPU is not kept warm
    wire_version: int = 0  # WIRE_VERSION of the sender (0: before versions were sent)
    model_id: str = ""  # what the KV means: model geometry, dtype and weights (config.model_fingerprint)
    # the agent our WRITEs and their notifications come from when a poster thread posts them ("": agent_name)
    post_agent: str = ""
    mem_kind: str = ""  # the memory NIXL moves: "VRAM" (the GPU pool) or "DRAM" (a host pool, or its mirror)


class HelloRefused(Msg, frozen=True):
    """A writer's answer to a Hello it refuses (another wire version, model or layout): the
    reason, and none of its NIXL metadata."""

    engine_id: str
    rank: int
    reason: str


class TransferStarting(Msg, frozen=True):
    """Writer to a peer writer over the handshake link, just before posting a transfer with it:
    drive NIXL progress until it ends (a WRITE with a notification completes only as the
    target progresses, and NIXL notifications have no file descriptor to wake on)."""

    transfer_id: str
    generation: int
    rank: int
    nbytes: int = 0


# Control travels on the handshake link too, once it is up (writer/posting.py ``control``): over UCX
# TCP a NIXL notification shares the connection that carries the KV bytes (issue 27), the link does
# not. WriteDone stays a notification: it must follow its WRITE's bytes.
HandshakeMsg = Union[Hello, TransferStarting, HelloRefused, Register, CancelTransfer, WriteFailed]


# ---------------------------------------------------------------------------
# Channel: any process <-> supervisor
# ---------------------------------------------------------------------------
class Ready(Msg, frozen=True):
    name: str  # e.g. "prefill-writer-0"
    pid: int
    pool: Optional[PoolHandle] = None  # writer: the pool it owns, which its worker maps
    agent: str = ""  # writer: its NIXL agent's name
    url: str = ""  # router: where it serves HTTP


class Shutdown(Msg, frozen=True):
    reason: str = ""


class Ping(Msg, frozen=True):
    # the supervisor's count of its pings (0: unnumbered), echoed in the Pong: a host's drain dates an answer by
    # the ping it answers (supervisor/host_drain.py)
    seq: int = 0


class Pong(Msg, frozen=True):
    name: str
    pid: int
    uptime_s: float
    restarts: int = 0
    # a scheduler: the requests it holds (queued, prefilling, P's KV being written or held for D's READ, D's
    # awaited or decoding), which its host's drain (--shutdown-timeout) waits out; -1: a process that holds none
    in_flight: int = -1
    ping_seq: int = 0  # the Ping.seq this answers (0: a sender that does not echo it)


ControlMsg = Union[Ready, Shutdown, Ping, Pong]


# ---------------------------------------------------------------------------
# Channel: control client (``pushkv status``...) <-> supervisor, on the same
# ROUTER socket as the children's Ready/Pong; and the supervisor's lifecycle
# events on its PUB socket (two frames: topic ``pushkv.<role>.<kind>.<event>``,
# then a LifecycleEvent). The commands themselves live in supervisor/commands.py.
# ---------------------------------------------------------------------------
class ControlCommand(Msg, frozen=True):
    command: str  # "status", "stop", ...
    args: dict[str, str] = {}


class ProcessInfo(msgspec.Struct, array_like=True, frozen=True, gc=False):
    name: str
    kind: str
    role: str
    rank: int
    pid: int
    state: str
    uptime_s: float
    restarts: int
    healthy: bool
    last_pong_age_s: float  # -1: never
    last_exit: str  # "running" (never exited), "exit code 3", "killed by SIGKILL": the last, restarted since or not
    instance: int = 0  # index of the instance of its role


class ControlReply(Msg, frozen=True):
    command: str
    status: str  # "ok" | "error"
    reason: str = ""
    processes: tuple[ProcessInfo, ...] = ()
    info: dict[str, str] = {}  # free-form text for people: deployment facts, command help


class LifecycleEvent(Msg, frozen=True):
    name: str  # process name, or "deployment" / "supervisor" / "<role>.instance"
    event: str  # "spawn", "ready", "exit", "restart", "unhealthy", "stop", ...
    pid: int = 0
    detail: str = ""
    restarts: int = 0
    t_wall: float = 0.0
    role: str = ""  # "prefill" | "decode" | "local" for an instance's processes; "" otherwise
    kind: str = ""  # "scheduler" | "worker" | "writer" | "router" | "instance"; "" for deployment events
    rank: int = 0
    instance: int = 0  # index of the instance of its role (several P or D on one host)


SupervisorInbound = Union[Ready, Pong, ControlCommand]


# ---------------------------------------------------------------------------
# Trace mirror: what any process sends/receives, for tools/trace/tap
# ---------------------------------------------------------------------------
class TraceEvent(Msg, frozen=True):
    t_mono: float
    t_wall: float
    process: str
    direction: str  # "send" | "recv" | "event"
    peer: str
    kind: str  # message type name
    transfer_id: str = ""
    payload: bytes = b""
    host: str = ""  # the process's host (its supervisor's advertised address; "" on one host)


# ---------------------------------------------------------------------------
# Encoders/decoders, built once
# ---------------------------------------------------------------------------
ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return ENCODER.encode(msg)


def decoder(union) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(union)


DEC_ROUTER_TO_SCHED = decoder(RouterToScheduler)
DEC_SCHED_TO_ROUTER = decoder(SchedulerToRouter)
DEC_SCHED_TO_WORKER = decoder(SchedulerToWorker)
DEC_WORKER_TO_SCHED = decoder(WorkerToScheduler)
DEC_SCHED_TO_WRITER = decoder(SchedulerToWriter)
DEC_WORKER_TO_WRITER = decoder(WorkerToWriter)
DEC_WRITER_TO_SCHED = decoder(WriterToScheduler)
DEC_PEER = decoder(PeerNotif)
DEC_HANDSHAKE = decoder(HandshakeMsg)
DEC_CONTROL = decoder(ControlMsg)
DEC_SUPERVISOR_IN = decoder(SupervisorInbound)
DEC_REPLY = decoder(ControlReply)
DEC_EVENT = decoder(LifecycleEvent)
DEC_TRACE = decoder(TraceEvent)

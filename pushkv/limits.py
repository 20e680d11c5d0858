"""What one request may cost, in one place.

The router refuses a request past any bound here with 400 naming the field
(``pushkv/router/api.py``); every scheduler checks the same bounds again on what
it receives (``SchedulerCore._refusal``), since anyone who reaches its socket
can send a ``Generate`` without the router; and every ZMQ socket caps the size
of a message it accepts (``zmq.MAXMSGSIZE``) at what the largest legal message
of this deployment's configuration encodes to, with a margin. A peer that sends
more is disconnected by ZeroMQ before a byte of it is decoded.

Ground: imports only ``config`` and ``messages``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pushkv import messages as m
from pushkv.config import DeploymentConfig, InstanceConfig
from pushkv.kv.layout import transfer_of

# -- request bounds (docs/api.md: the table is checked against BOUNDS by tests/router/test_request_limits.py)
MAX_N = 16  # choices: each one is its own prefill and decode (OpenAI allows 128 and bills them)
MAX_BEST_OF = MAX_N  # and best_of must equal n: nothing ranks candidates
MAX_LOGPROBS = 20  # completions' logprobs, chat's top_logprobs: OpenAI's and vLLM's (max_logprobs) 20
MAX_LOGIT_BIAS = 1024  # logit_bias entries: a forced choice or a banned word list fits; each is a scatter per step
LOGIT_BIAS_ABS = 100.0  # |bias|, as OpenAI documents
MAX_ALLOWED_TOKEN_IDS = 1024  # vLLM's allowed_token_ids: a choice among labels fits; they ride in every step's message
MAX_BAD_WORDS = 64  # vLLM's bad_words: each is matched against the output's end every step
MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word as the tokenizer writes it: a word or a phrase, not a passage
MAX_REASONING_END_IDS = 64  # structured output with a reasoning parser: the ids of its end tag ("</think>")
MAX_STRUCTURED_CHARS = 64 << 10  # a structured output's schema, regex, choices or grammar: every Generate carries it
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt: a tenant's name or key, in every Generate
MAX_CLIENT_ID_CHARS = 256  # a client's request id (X-Request-Id, vLLM's request_id): logged and kept per request
MAX_STOPS = 16  # stop strings (OpenAI: 4): every output text is searched for each
MAX_STOP_CHARS = 256  # characters in one stop string: a stop is a delimiter, not a passage
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids, before the model's EOS ids are added: suppressed per step until min_tokens
MAX_PROMPTS = 64  # completions' prompt list: a batch, each prompt its own choices
MAX_CHOICES = 256  # a request's prompts x n: each choice is its own prefill and decode
MAX_TOOLS = 128  # chat's tools, OpenAI's bound: each is rendered into the prompt
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5  # a temperature above 0 and below this is greedy (vLLM's _SAMPLING_EPS): 1/T overflows
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI
MAX_REPETITION_PENALTY = 100.0  # vLLM's repetition_penalty, in (0, this]: checkpoints ship 1.0-1.3
HTTP_BODY_MIN_BYTES = 1 << 20  # aiohttp's default client_max_size
HTTP_BODY_BYTES_PER_TOKEN = 64  # a prompt of max_model_len tokens in JSON: ids or escaped text, with room


@dataclass(frozen=True)
class Bound:
    field: str
    bound: str
    why: str


BOUNDS = (
    Bound("n", f"1-{MAX_N}", "each choice is its own prefill and decode"),
    Bound("best_of", f"1-{MAX_BEST_OF}, equal to n", "nothing ranks candidates"),
    Bound("logprobs (completions), top_logprobs (chat)", f"0-{MAX_LOGPROBS}", "OpenAI's and vLLM's bound"),
    Bound("prompt_logprobs (vLLM's; echo with logprobs scores the prompt with as many)", f"0-{MAX_LOGPROBS}",
          "vLLM's max_logprobs; every prompt position gives that many"),
    Bound("logit_bias", f"at most {MAX_LOGIT_BIAS} entries; keys canonical token ids (\"7\", not \"07\", "
          f"\" 7\", \"+7\", \"7.0\"); values -{LOGIT_BIAS_ABS:g} to {LOGIT_BIAS_ABS:g}",
          "one scatter per entry per step, in every step's message"),
    Bound("allowed_token_ids (vLLM's)", f"1-{MAX_ALLOWED_TOKEN_IDS} ids, each in the vocabulary",
          "they ride in every step's message"),
    Bound("bad_words (vLLM's)", f"at most {MAX_BAD_WORDS} words of 1-{MAX_BAD_WORD_TOKENS} tokens each",
          "each is matched against the output's end every step"),
    Bound("structured output (response_format, structured_outputs, guided_*)",
          f"one grammar of at most {MAX_STRUCTURED_CHARS} characters", "each scheduler compiles it"),
    Bound("cache_salt (vLLM's)", f"a string of 1-{MAX_CACHE_SALT_CHARS} characters", "it rides in every Generate"),
    Bound("X-Request-Id header, request_id (vLLM's)", f"1-{MAX_CLIENT_ID_CHARS} printable ASCII characters, no "
          "spaces", "it is logged and names the response"),
    Bound("stop", f"at most {MAX_STOPS} strings of 1-{MAX_STOP_CHARS} characters",
          "the output is searched for each"),
    Bound("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, each in the vocabulary",
          "suppressed every step until min_tokens"),
    Bound("prompt (completions)", f"a prompt, or a batch of at most {MAX_PROMPTS}, prompts x n at most "
          f"{MAX_CHOICES} choices; each prompt under max_model_len, max_tokens cut to the room left (vLLM 0.32's)",
          "each choice is its own prefill and decode"),
    Bound("tools (chat)", f"at most {MAX_TOOLS}", "OpenAI's bound; each is rendered into the prompt"),
    Bound("repetition_penalty (vLLM's)", f"above 0, at most {MAX_REPETITION_PENALTY:g}",
          "a logit divided or multiplied by it stays finite"),
    Bound("temperature", f"0-{MAX_TEMPERATURE:g}; below {MIN_TEMPERATURE:g} is greedy",
          "1/T overflows the logits"),
    Bound("request body", f"max({HTTP_BODY_MIN_BYTES >> 20} MiB, {HTTP_BODY_BYTES_PER_TOKEN} B x max_model_len)",
          "413 past it"),
)


def max_len(cfg: DeploymentConfig) -> int:
    return cfg.max_model_len or cfg.model.max_position


def stop_ids_bound(cfg: DeploymentConfig) -> int:
    """Stop ids a ``Generate`` may carry: the request's plus the model's EOS ids."""
    return MAX_STOP_TOKEN_IDS + len(cfg.model.all_eos_ids)


def suppress_bound(cfg: DeploymentConfig) -> int:
    """Ids a step may suppress for one sequence: its stop ids (before min_tokens) and one per bad word's two
    spellings (with and without a leading space)."""
    return stop_ids_bound(cfg) + 2 * MAX_BAD_WORDS


def http_body_bytes(cfg: DeploymentConfig) -> int:
    return max(HTTP_BODY_MIN_BYTES, HTTP_BODY_BYTES_PER_TOKEN * max_len(cfg))


# -- ZMQ message caps
# Messages that do not grow with a request: a writer's Hello (its NIXL metadata: 495 bytes for a
# CPU pool here), Ready with a pool handle, stats, lifecycle events, control commands. Their cap,
# and the floor of every other cap.
CONTROL_MSG_BYTES = 4 << 20
MARGIN = 2  # a cap is this many times the largest legal message, so no legal one ever comes near
GENERATE_MIN_BYTES = 64 << 10
ENDPOINT_CHARS = 256  # a tcp:// or ipc:// endpoint, generously
ID_CHARS = 128  # transfer ids, engine ids


UNSIZED_BLOCK_ID = (1 << 32) - 1  # the widest id a pool sized elsewhere could give, as msgpack writes it


def _instances(cfg: DeploymentConfig) -> list[InstanceConfig]:
    if cfg.mode == "local":
        return [cfg.local]
    return cfg.role_instances("prefill") + cfg.role_instances("decode")


def _worst_sampling(cfg: DeploymentConfig) -> m.SamplingParams:
    top = cfg.model.vocab_size - 1
    bias = tuple((top - i, -LOGIT_BIAS_ABS - 0.1) for i in range(MAX_LOGIT_BIAS))  # a float64 each
    return m.SamplingParams(temperature=0.1, top_p=0.1, top_k=top, min_p=0.1, seed=(1 << 64) - 1,
                            presence_penalty=-0.1, frequency_penalty=-0.1, logit_bias=bias,
                            logprobs=MAX_LOGPROBS, min_tokens=max_len(cfg), prompt_logprobs=MAX_LOGPROBS,
                            allowed_token_ids=(top,) * MAX_ALLOWED_TOKEN_IDS,
                            bad_words=((top,) * MAX_BAD_WORD_TOKENS,) * (2 * MAX_BAD_WORDS),
                            repetition_penalty=MAX_REPETITION_PENALTY - 0.1)


def largest_generate(cfg: DeploymentConfig) -> m.Generate:
    """The largest ``Generate`` the router can send in this deployment (an upper bound: every
    field at once, each at its largest)."""
    n, top = max_len(cfg), cfg.model.vocab_size - 1
    tp = max(i.tp for i in _instances(cfg))
    block = min(i.block_size for i in _instances(cfg))
    # a pool sized at launch on another host (num_blocks 0 here) may hand out any block id
    num_blocks = max(i.num_blocks for i in _instances(cfg)) if all(i.num_blocks for i in _instances(cfg)) \
        else UNSIZED_BLOCK_ID
    source = m.PrefillSource("e" * ID_CHARS, tp, ("t" * ENDPOINT_CHARS,) * tp)
    pull = m.PullParams(source, (num_blocks,) * -(-n // block), n, top, 1e9 + 0.1, _largest_checksums(cfg, n))
    return m.Generate("t" * ID_CHARS, (1 << 63) - 1, "prefill", (top,) * n, n, (top,) * stop_ids_bound(cfg),
                      source, pull, 1e9 + 0.1, _worst_sampling(cfg), True, True, "\U0010ffff" * MAX_CACHE_SALT_CHARS,
                      m.Structured("json_object", "\U0010ffff" * MAX_STRUCTURED_CHARS,
                                   after=(top,) * MAX_REASONING_END_IDS))


def _checksum_groups(cfg: DeploymentConfig) -> int:
    """Layer groups P's pool is cut into (``kv.layout.layer_groups``), as the transfer plan says:
    full and window attention, or with layer-streamed push up to ``push_stream_groups`` runs of layers."""
    return transfer_of(cfg).groups


def _largest_checksums(cfg: DeploymentConfig, n: int) -> Optional[m.KVChecksums]:
    """--kv-verify full: a 64-bit sum per (unit of P's block size, layer group, KV head)."""
    if cfg.kv_verify == "off":
        return None
    units = -(-n // cfg.prefill.block_size)
    heads = cfg.model.cache_kv_heads
    return m.KVChecksums(cfg.prefill.block_size, n, tuple(range(units)), tuple(range(heads)),
                         bytes(8 * units * _checksum_groups(cfg) * heads))


def generate_cap_bytes(cfg: DeploymentConfig) -> int:
    """Cap of a scheduler's socket from the router (``Generate``, ``Abort``, ``GetStats``, ``PeerLost``)."""
    return max(GENERATE_MIN_BYTES, MARGIN * len(m.encode(largest_generate(cfg))))


def step_bytes(cfg: DeploymentConfig, inst: InstanceConfig) -> int:
    """An upper bound on one ``ExecuteStep`` of ``inst``: max_num_seqs sequences, each with a whole
    prompt to run, a whole output history and a full block table."""
    n, top = max_len(cfg), cfg.model.vocab_size - 1
    seq = m.SeqWork((1 << 63) - 1, (top,) * n, n, (inst.num_blocks,) * -(-n // inst.block_size), True,
                    _worst_sampling(cfg), n, (top,) * n, bytes(4 * min(n, top + 1)), (top,) * suppress_bound(cfg))
    return inst.max_num_seqs * len(m.encode(seq)) + 64


def _widest_logprob(cfg: DeploymentConfig) -> m.TokenLogprob:
    """A sampled token's logprob at the widest: ``MAX_LOGPROBS`` alternatives, the largest ids."""
    top = cfg.model.vocab_size - 1
    return m.TokenLogprob(-1e30, (top,) * MAX_LOGPROBS, (-1e30,) * MAX_LOGPROBS)


def _prompt_logprobs(positions: int) -> m.PromptLogprobs:
    """Prompt logprobs of ``positions`` scored positions at the widest (``MAX_LOGPROBS`` each)."""
    n, k = positions, MAX_LOGPROBS
    return m.PromptLogprobs((1 << 63) - 1, n, k, bytes(4 * n), bytes(4 * n), bytes(4 * n * k), bytes(4 * n * k))


def step_done_bytes(cfg: DeploymentConfig, inst: InstanceConfig) -> int:
    """An upper bound on one ``StepDone`` of ``inst``: a token and the widest logprobs per
    sequence, (--kv-verify, P) the checksums of every prompt whose last chunk the step
    stored, which together hold at most the pool's tokens, and the prompt logprobs of every
    position the step computed, at most the pool's tokens too (a prompt's blocks are all held)."""
    top = cfg.model.vocab_size - 1
    lp = _widest_logprob(cfg)
    done = m.StepDone((1 << 63) - 1, (top,) * inst.max_num_seqs, 1e9 + 0.1, (lp,) * inst.max_num_seqs)
    n = min(max_len(cfg), inst.num_blocks * inst.block_size)
    sums = _largest_checksums(cfg, n) if inst.role == "prefill" else None
    prompts = min(inst.max_num_seqs, -(-inst.num_blocks * inst.block_size // max(1, n)))
    scored = min(inst.max_num_seqs * max_len(cfg), inst.num_blocks * inst.block_size or max_len(cfg))
    scores = len(m.encode(_prompt_logprobs(scored))) + inst.max_num_seqs * len(m.encode(_prompt_logprobs(0)))
    return len(m.encode(done)) + (prompts * len(m.encode(sums)) if sums is not None else 0) + scores


def tokens_bytes(cfg: DeploymentConfig) -> int:
    """An upper bound on one ``TokensGenerated``: a finished one with every field, its prompt's
    logprobs at the widest included."""
    top = cfg.model.vocab_size - 1
    lp = _widest_logprob(cfg)
    stages = tuple(("s" * ID_CHARS, 1e9 + 0.1) for _ in range(64))
    msg = m.TokensGenerated("t" * ID_CHARS, (1 << 63) - 1, (top,), True, "length", max_len(cfg), stages,
                            m.KVTransferStats(1 << 62, 1 << 62, 1e9, "pull", 1e9, 1 << 62, 1 << 62, "s" * ID_CHARS),
                            (lp,), max_len(cfg), 1 << 62, 1 << 62, 1 << 62, 1 << 62,
                            _prompt_logprobs(max_len(cfg)))
    return len(m.encode(msg))


def msg_cap_bytes(cfg: DeploymentConfig) -> int:
    """The cap of every socket of this deployment that is neither a scheduler's front nor a
    control socket: past the largest legal message on any channel (a step to a worker and its
    answer, a transfer's block ids and checksums, a prompt's logprobs to the router, a trace
    event that carries any of them), with the margin."""
    largest = max([len(m.encode(largest_generate(cfg))), tokens_bytes(cfg)]
                  + [step_bytes(cfg, i) for i in _instances(cfg)] + [step_done_bytes(cfg, i) for i in _instances(cfg)])
    return max(CONTROL_MSG_BYTES, MARGIN * largest + (64 << 10))

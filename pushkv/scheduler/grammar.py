"""Structured output in a scheduler: each asking request's grammar, and the tokens each of its steps may draw.

Every scheduler that draws a request's tokens holds it to its grammar: P for the first token, D (or a local
instance) for the rest. A request's ``Matcher`` follows its output (P's first token included, which D received
with the KV), and gives each step the mask of the tokens that keep the output valid (``SeqWork.token_mask``,
xgrammar's bitmask: bit t of int32 word t // 32); the worker's sampler sets the others to -inf. The grammar is
compiled once per scheduler and spec (the core's ``Grammars``, an LRU of ``CACHED``), over the model's tokenizer:
the checkpoint's, or the built-in byte tokenizer of the random-weight presets.

The compile never runs on the scheduler's loop (a JSON schema takes milliseconds to seconds; the tokenizer is
loaded at the first): a spec already compiled gives its matcher at once, and for any other the core holds the
request (``State.GRAMMAR``, vLLM's WAITING_FOR_FSM) and asks its shell to compile it (``outbox.CompileGrammar``,
once per spec however many requests wait for it). The shell's ``CompileThreads`` compiles on daemon threads
(xgrammar lets go of the GIL meanwhile) and wakes the loop through an eventfd in its poller; the core takes each
``GrammarCompiled`` (``SchedulerCore.compiled``) and queues the requests held for it, or fails them (400).
"""
from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict, deque
from typing import Any, Callable, NamedTuple, Optional, Sequence

from pushkv.config import ModelConfig
from pushkv.grammars import grammar_of
from pushkv.messages import Structured

CACHED = 64  # compiled grammars a scheduler keeps
COMPILE_THREADS = 2  # a scheduler's compile threads: a large schema does not hold up a small one behind it
BYTE_EOS = 257  # the built-in byte tokenizer's EOS (pushkv.model.tokenizer.ByteTokenizer)


def _byte_level_names() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which xgrammar reads a byte-level vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    names = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def tokenizer_info(cfg: ModelConfig):
    """xgrammar's view of the model's tokenizer: the checkpoint's tokenizer.json, or the byte tokenizer (ids 0-255
    the bytes, the rest special)."""
    import xgrammar as xgr

    where = cfg.tokenizer or cfg.checkpoint
    stops = list(cfg.all_eos_ids)
    if where:
        import transformers

        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(where, "tokenizer.json"))
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=cfg.vocab_size, stop_token_ids=stops or None)
    names = _byte_level_names()
    vocab = [names[b] for b in range(256)] + [""] * (cfg.vocab_size - 256)
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=cfg.vocab_size,
                             stop_token_ids=stops or [BYTE_EOS], add_prefix_space=False)


def failure(e: BaseException) -> str:
    """What a request is told (a 400) when its grammar did not compile, or its matcher could not be made."""
    return f"structured output: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


class Grammars:
    """The core's compiled grammars (an LRU of ``CACHED``) and the matchers made of them; compiles none itself
    (``XgrammarCompile`` does, on the shell's ``CompileThreads``)."""

    def __init__(self, cfg: ModelConfig):
        self.vocab = cfg.vocab_size
        self._compiled: OrderedDict = OrderedDict()

    def matcher(self, spec: Structured) -> Optional["Matcher"]:
        """A fresh matcher of ``spec``'s grammar when it is compiled here; None when it is not (yet)."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            return None
        self._compiled.move_to_end(spec)
        return self.matcher_of(spec, compiled)

    def add(self, spec: Structured, compiled: Any) -> None:
        self._compiled[spec] = compiled
        self._compiled.move_to_end(spec)
        if len(self._compiled) > CACHED:
            self._compiled.popitem(last=False)

    def matcher_of(self, spec: Structured, compiled: Any) -> "Matcher":
        """A matcher that holds the output from the start, or with ``spec.after`` from the output's first ``after`` on:
        the router sends one only where the output reasons (it reads the prompt and the request: a prompt that closed
        the reasoning gets none), so an earlier turn's end tag in the prompt starts nothing here."""
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(compiled), self.vocab, spec.after, not spec.after)


class XgrammarCompile:
    """``compile(spec)``: the spec's grammar compiled over the model's tokenizer, by one xgrammar
    ``GrammarCompiler`` made at the first call (loading the tokenizer) and shared by the compile threads."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._compiler: Any = None
        self._lock = threading.Lock()

    def __call__(self, spec: Structured) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.cfg), max_threads=1)
        return self._compiler.compile_grammar(grammar_of(spec))


class GrammarCompiled(NamedTuple):
    """A compile's end, handed to the core (``SchedulerCore.compiled``)."""

    spec: Structured
    grammar: Any  # xgrammar's CompiledGrammar; None when it failed
    error: str = ""  # what the requests that wait for it are told (``failure``), when it failed


def compiled_of(compile: Callable[[Structured], Any], spec: Structured) -> GrammarCompiled:
    """One compile's end: its grammar, or why it failed."""
    try:
        return GrammarCompiled(spec, compile(spec))
    except Exception as e:  # a spec the router did not check (a direct sender), xgrammar missing here
        return GrammarCompiled(spec, None, failure(e))


class CompileThreads:
    """The scheduler shell's compiles, off its loop: ``submit(spec)`` queues one for the threads (daemons,
    started at the first); each that ends is kept as a ``GrammarCompiled`` and ``fd`` (an eventfd the loop polls)
    turns readable; ``take()`` hands over those ended so far; ``cancel(spec)`` drops the last compile of ``spec``
    queued and not yet started (one under way ends as ever). ``close()`` never waits for a compile under way: one
    that ends after it is dropped."""

    def __init__(self, compile: Callable[[Structured], Any], threads: int = COMPILE_THREADS):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._compile = compile
        self._size = threads
        self._threads: list[threading.Thread] = []
        self._jobs: "queue.SimpleQueue[Optional[tuple[int, Structured]]]" = queue.SimpleQueue()
        self._queued: dict[Structured, list[int]] = {}  # each spec's jobs queued and not started, by number
        self._cancelled: set[int] = set()
        self._next = 0
        self._done: deque[GrammarCompiled] = deque()
        self._lock = threading.Lock()  # a thread's result and its wakeup never race close() (fd reuse)
        self._closed = False

    def submit(self, spec: Structured) -> None:
        if self._closed:
            return
        if not self._threads:
            for i in range(self._size):
                t = threading.Thread(target=self._run, name=f"pushkv-grammar-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        with self._lock:
            self._next += 1
            job = self._next
            self._queued.setdefault(spec, []).append(job)
        self._jobs.put((job, spec))

    def cancel(self, spec: Structured) -> bool:
        """Drop ``spec``'s last queued compile that has not started; whether there was one."""
        with self._lock:
            jobs = self._queued.get(spec)
            if not jobs:
                return False
            self._cancelled.add(jobs.pop())
            if not jobs:
                del self._queued[spec]
            return True

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, spec = item
            with self._lock:
                jobs = self._queued.get(spec, [])
                if job in jobs:
                    jobs.remove(job)
                    if not jobs:
                        del self._queued[spec]
                if job in self._cancelled:
                    self._cancelled.discard(job)
                    continue
            done = compiled_of(self._compile, spec)
            with self._lock:
                if self._closed:
                    return
                self._done.append(done)
                os.eventfd_write(self.fd, 1)

    def take(self) -> list[GrammarCompiled]:
        with self._lock:
            if self._closed:
                return []
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass
            out = list(self._done)
            self._done.clear()
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.fd)
        for _ in self._threads:
            self._jobs.put(None)  # the idle ones end now, a busy one after its compile


def _holds(seq: Sequence[int], part: Sequence[int], start: int = 0) -> int:
    """Where ``part`` ends in ``seq`` at its first occurrence from ``start`` (0: nowhere)."""
    n = len(part)
    for i in range(max(start, 0), len(seq) - n + 1):
        if list(seq[i:i + n]) == list(part):
            return i + n
    return 0


class Matcher:
    """One request's grammar state, following its output; with a reasoning parser, from the tokens that end the
    reasoning on (``after``)."""

    def __init__(self, matcher: Any, vocab: int, after: Sequence[int] = (), active: bool = True):
        import xgrammar as xgr

        self.m = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.after = tuple(after)
        self.start = 0 if active else -1  # the output index the grammar holds from; -1: still reasoning
        self.accepted = 0  # output tokens the grammar has taken (from start)
        self.broken = False  # a token the grammar did not allow came (it never should: every draw was masked)

    def advance(self, output: Sequence[int]) -> None:
        if self.start < 0:  # reasoning: look for its end among the new tokens (and the few before them)
            end = _holds(output, self.after, self.accepted - len(self.after) + 1)
            self.accepted = len(output)
            if not end:
                return
            self.start = self.accepted = end
        for t in output[self.accepted:]:
            if not self.broken and not self.m.accept_token(t):
                self.broken = True
        self.accepted = len(output)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its end (a stop token), or can take nothing more."""
        return self.start >= 0 and (self.broken or self.m.is_terminated())

    def mask(self, output: Sequence[int]) -> bytes:
        """The tokens the next draw may take, after ``output``: xgrammar's bitmask, packed (b"": any, while the
        model still reasons)."""
        self.advance(output)
        if self.start < 0:
            return b""
        self.m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy().astype("<i4").tobytes()


def allowed_ids(mask: bytes, vocab: int) -> Optional[list[int]]:
    """The ids a packed mask allows (for the scheduler's checks; None for no mask)."""
    if not mask:
        return None
    import numpy as np

    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()

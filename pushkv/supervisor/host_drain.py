"""A P or D host's drain at stop (``--shutdown-timeout N`` on ``pushkv up --role prefill|decode``): when it ends.

The host first marks its instances' registry records ``draining``: every router chooses them for no new request
and leaves the requests with a leg on them alone. The host then waits until its schedulers hold no request (a P's
until its writers say the KV was written or read, a D's until it ends), N seconds have passed, or a second signal
came; only then does it leave the registry and stop, as without the flag (a router fails what is still in flight
then, with 503).

The schedulers say what they hold in their ``Pong`` (``in_flight``), pinged often while the host drains. An answer
counts only once the routers have had ``settle_s`` to see the mark: a router places a request until its watch
delivers the mark, and that request's messages reach the scheduler a moment later still, so an idle answer before
then proves nothing. The routers see the mark once etcd holds it: where its put had to wait (a slow etcd, or one
out of reach as the host stops, the put retried), the settle counts from when it landed (``seen_from``), else an
idle host would leave while the routers still choose it.

An answer is dated by the ping it answers (``Pong.ping_seq`` echoes ``Ping.seq``; ``pinged`` records when each was
sent), not by when it arrived: a scheduler counts what it holds when the ping reaches it, so an idle answer to a ping
sent before the settle point, received after it (a busy loop, a slow scheduler), says nothing of the requests the
routers placed meanwhile. An answer to no ping of this drain (``ping_seq`` 0: sent before the drain, or by a process
that does not echo it) never counts. Pure: times are handed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SETTLE_S = 1.0  # the routers' watch delivers the mark, and what they placed before it reaches the schedulers
PING_S = 0.2  # the schedulers are asked this often while the host drains

DONE, TIMEOUT, SIGNAL = "done", "timeout", "signal"


@dataclass
class HostDrain:
    marked: float  # when the records were marked draining (monotonic)
    until: float  # when the host stops at the latest (marked + N)
    settle_s: float = SETTLE_S
    # scheduler -> (requests held, when the ping it answered was sent)
    said: dict[str, tuple[int, float]] = field(default_factory=dict)
    sent: dict[int, float] = field(default_factory=dict)  # the drain's pings: sequence number -> when sent

    @classmethod
    def start(cls, now: float, timeout_s: float, settle_s: float = SETTLE_S) -> "HostDrain":
        return cls(marked=now, until=now + timeout_s, settle_s=settle_s)

    def seen_from(self, t: float) -> None:
        """The routers can see the mark from ``t`` at the earliest (its put landed then, or has not yet at ``t``):
        an answer counts only from ``t`` + the settle. The drain's end at the latest (``until``) stays."""
        self.marked = max(self.marked, t)

    def pinged(self, seq: int, now: float) -> None:
        """The supervisor sent Ping ``seq`` at ``now`` (taken before the send: an answer is dated no later than it
        was asked for)."""
        self.sent[seq] = now

    def answer(self, scheduler: str, in_flight: int, ping_seq: int) -> None:
        """A scheduler's Pong to the drain's Ping ``ping_seq``: the requests it holds (a process that holds none
        says -1, and is not asked for). Dated by its ping; one to no ping of the drain, or older than the last
        counted, changes nothing."""
        asked = self.sent.get(ping_seq)
        if in_flight < 0 or asked is None:
            return
        if scheduler not in self.said or self.said[scheduler][1] <= asked:
            self.said[scheduler] = (in_flight, asked)

    def held(self, schedulers: set[str]) -> int:
        """The requests the named schedulers last said they hold (what the log says at the end)."""
        return sum(self.said[s][0] for s in schedulers if s in self.said)

    def idle(self, schedulers: set[str]) -> bool:
        """Every named scheduler (those of the instances still whole) said, asked after the routers saw the mark,
        that it holds nothing. None named (every instance gone): nothing left to wait for."""
        settled = self.marked + self.settle_s
        return all(s in self.said and self.said[s][0] == 0 and self.said[s][1] >= settled for s in schedulers)

    def verdict(self, now: float, schedulers: set[str], signalled_again: bool) -> str:
        """'' while the drain goes on; else why it ends: DONE (nothing left in flight), TIMEOUT (N s passed),
        SIGNAL (a second stop signal: stop now, as a second Ctrl-C does under ``vllm serve``)."""
        if signalled_again:
            return SIGNAL
        if self.idle(schedulers):
            return DONE
        if now >= self.until:
            return TIMEOUT
        return ""

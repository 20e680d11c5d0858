"""Messages bounded as wholes (pushkv/framing.py): a message past its channel's shape, in frames or
in bytes, is dropped whole, on a real socket pair (inproc), sync and asyncio alike."""
import asyncio
from collections import Counter

import pytest
import zmq
import zmq.asyncio

from pushkv.framing import ENVELOPE_BYTES, Drops, Shape, arecv_bounded, judge, recv_bounded

CAP = 64 << 10


@pytest.mark.parametrize("nbytes,nframes,why", [
    (10, 1, ""), (CAP + ENVELOPE_BYTES, 3, ""), (CAP + ENVELOPE_BYTES + 1, 3, "bytes"), (10, 4, "frames"),
    (2**40, 64, "frames"),  # frames are judged first: 64 frames of 4 MiB is the case
])
def test_judge(nbytes, nframes, why):
    assert judge(nbytes, nframes, Shape(3, CAP + ENVELOPE_BYTES)) == why


# what a DEALER sends to a ROUTER; the ROUTER sees the identity first (3 frames at most)
CASES = [
    ("one payload", [b"x" * 100], ""),
    ("REQ-style delimiter", [b"", b"x" * 100], ""),
    ("whole payload at the cap", [b"x" * CAP], ""),
    ("too many frames", [b"x"] * 8, "frames"),
    ("many frames, each under the cap (the issue's 64 x 4 MiB, scaled)", [b"x" * (CAP // 2)] * 64, "frames"),
    ("two frames over the cap together", [b"x" * (CAP // 2 + 600)] * 2, "bytes"),
]


def _pair(ctx):
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, CAP)
    router.bind("inproc://framing-test")
    dealer.connect("inproc://framing-test")
    return router, dealer


@pytest.mark.parametrize("name,parts,why", CASES, ids=[c[0] for c in CASES])
def test_recv_bounded(name, parts, why):
    ctx = zmq.Context()
    try:
        router, dealer = _pair(ctx)
        shape = Shape.of(router)
        assert shape.frames == 3 and shape.nbytes == CAP + ENVELOPE_BYTES
        dealer.send_multipart(parts)
        dealer.send(b"next")  # the socket stays usable and in step after a drop
        assert router.poll(5000)
        frames, got_why, n, nbytes = recv_bounded(router, shape)
        assert got_why == why and n == len(parts) + 1, (got_why, n)  # the identity frame, then the parts
        assert nbytes > sum(map(len, parts))  # counted whole, the identity too
        assert (frames is None) == bool(why)
        if frames is not None:
            assert frames[1:] == parts
        assert router.poll(5000)
        frames, got_why, *_ = recv_bounded(router, shape)
        assert got_why == "" and frames[-1] == b"next"
    finally:
        ctx.destroy(0)


@pytest.mark.parametrize("name,parts,why", CASES, ids=[c[0] for c in CASES])
def test_arecv_bounded(name, parts, why):
    async def run():
        ctx = zmq.asyncio.Context()
        try:
            router, dealer = _pair(ctx)
            shape = Shape.of(router)
            await dealer.send_multipart(parts)
            await dealer.send(b"next")
            frames, got_why, n, _ = await asyncio.wait_for(arecv_bounded(router, shape), 5)
            assert got_why == why and n == len(parts) + 1 and (frames is None) == bool(why)
            frames, got_why, *_ = await asyncio.wait_for(arecv_bounded(router, shape), 5)
            assert got_why == "" and frames[-1] == b"next"
        finally:
            ctx.destroy(0)

    asyncio.run(run())


def test_drops_count_every_one_and_log_once_per_interval(caplog):
    c: Counter = Counter()
    d = Drops("p-writer-0", c)
    with caplog.at_level("ERROR", logger="pushkv.framing"):
        for _ in range(100):
            d.drop("peer-handshake", "frames", 64, 1 << 28, Shape(3, CAP))
    assert c["msg_dropped_frames"] == 100
    assert len([r for r in caplog.records if "dropped a message" in r.getMessage()]) == 1

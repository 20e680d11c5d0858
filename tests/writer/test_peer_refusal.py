"""What a refused Hello tells its sender (pure: the peer table's refusal, no sockets, no NIXL).

A peer that reached us through an authenticated channel (CURVE with our secret, or an ipc file
in the 0700 run dir) is one of ours and gets the reason; anyone else gets one generic word, and
the reason goes only to our log."""
from collections import Counter

import msgspec
import pytest

from pushkv import messages as m
from pushkv.writer.peers import GENERIC_REFUSAL, Peers


class RefusingShell:
    """A writer shell without an actor loop, for its ``Peers``: what it sends is recorded; a
    peer's layout is refused when ``bad_layout``."""

    def __init__(self, authenticated: bool, bad_layout: bool = False):
        self.name, self.engine_id, self.rank, self.model_id = "p-writer-0", "p", 0, "model-a"
        self.counters: Counter = Counter()
        self.peers = Peers(self)  # type: ignore[arg-type]  # a fake shell: only what a refusal uses
        self.peers.handshake = object()  # type: ignore[assignment]  # only compared, never used as a socket
        self.peers.authenticated = authenticated
        self.bad_layout = bad_layout
        self.sent: list = []

    def send(self, ch, msg, identity=None) -> None:  # type: ignore[override]
        self.sent.append((msg, identity))

    def check_peer(self, h) -> None:
        if self.bad_layout:
            raise ValueError("block size differs: ours 16, theirs 32")


GOOD = m.Hello("d", 0, 1, "d-w0", b"", 0, None, wire_version=m.WIRE_VERSION, model_id="model-a")


@pytest.mark.parametrize("change,bad_layout,says", [
    ({"model_id": "model-b"}, False, "model differs"),
    ({"wire_version": m.WIRE_VERSION + 1}, False, "wire version differs"),
    ({}, True, "block size differs"),
])
@pytest.mark.parametrize("authenticated", [True, False])
def test_refusal_says_why_only_to_our_own(change, bad_layout, says, authenticated):
    w = RefusingShell(authenticated, bad_layout)
    w.peers.on_hello(msgspec.structs.replace(GOOD, **change), identity=b"peer-1")
    [(msg, ident)] = w.sent
    assert isinstance(msg, m.HelloRefused) and ident == b"peer-1"
    if authenticated:
        assert says in msg.reason, msg.reason
    else:
        assert msg.reason == GENERIC_REFUSAL, msg.reason
        assert "model-a" not in msg.reason  # nothing of ours: not the model, not the layout
    assert w.peers.table == {} and w.counters["peer_incompatible"] == 1

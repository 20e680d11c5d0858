"""P's worker's layer marks (worker/marks.py): sent as the forward passes a group, never without
the group's event on a GPU."""
from __future__ import annotations

import msgspec
import pytest
import zmq

from pushkv import messages as m
from pushkv.kv import layer_events
from pushkv.worker.marks import LayerMarks

GROUPS = ((0, 1), (2, 3))


@pytest.fixture
def sink(tmp_path):
    sock = zmq.Context.instance().socket(zmq.PULL)
    ep = f"ipc://{tmp_path}/marks"
    sock.bind(ep)
    yield ep, sock
    sock.close(0)


def _got(sock) -> list[m.LayersStored]:
    out = []
    while sock.poll(200):
        out.append(msgspec.msgpack.decode(sock.recv(), type=m.LayersStored))
    return out


def test_a_cpu_mark_goes_at_once_after_each_groups_last_layer(sink):
    ep, sock = sink
    marks = LayerMarks(ep, GROUPS, "cpu")
    on_layer = marks.hook(7, ())
    for layer in range(4):
        on_layer(layer)
    got = _got(sock)
    marks.close()
    assert [(g.step_id, g.group, g.event) for g in got] == [(7, 0, b""), (7, 1, b"")]
    assert all(g.recorded > 0 for g in got)


def test_a_gpu_worker_without_inter_process_events_sends_no_mark(sink, monkeypatch):
    """A mark with no event on a GPU would let P's writer WRITE bytes not yet stored: none is sent,
    and the KV leaves with the prefill's end."""
    ep, sock = sink

    def refuse(device):
        raise RuntimeError("no IPC events here")

    monkeypatch.setattr(layer_events, "EventRing", refuse)
    marks = LayerMarks(ep, GROUPS, "cuda:0")
    on_layer = marks.hook(1, ())
    for layer in range(4):
        on_layer(layer)
    assert marks.failed and _got(sock) == []
    marks.close()


def test_device_index():
    assert [layer_events.device_index(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3")] == [-1, 0, 0, 3]

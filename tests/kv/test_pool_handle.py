"""The pool handle a writer reports and its worker maps: typed, checked, round-tripped."""
from __future__ import annotations

import os
import uuid

import msgspec
import pytest

from pushkv import messages as m
from pushkv.config import preset
from pushkv.kv import layout as L
from pushkv.kv.handle import POOL_ENV, handle_from_env, handle_to_env
from pushkv.kv.pool import attach_pool, attach_worker_pool, create_pool


@pytest.fixture
def lay():
    return L.layout_for(preset("tiny"), 1, 0, num_blocks=4, block_size=16)


def test_ready_carries_the_handle_typed_and_the_env_round_trips(lay):
    h = m.PoolHandle("cuda_ipc", "", L.pool_bytes(lay), "float32", L.pool_shape(lay), ipc=b"\x93\x01\x02\x03")
    ready = m.DEC_CONTROL.decode(m.encode(m.Ready("decode-writer-0", 42, pool=h, agent="d-w0")))
    assert ready.pool == h and ready.agent == "d-w0"
    assert handle_from_env(handle_to_env(h)) == h


@pytest.mark.parametrize("value", ["cuda_ipc:AAAA", "not base64 !", handle_to_env(m.PoolHandle("shm", "x", 1, "float32", ()))[:-4]])
def test_a_bad_env_handle_is_refused_by_name(value):
    with pytest.raises(ValueError, match=POOL_ENV):
        handle_from_env(value)


def test_worker_maps_the_writers_pool_from_the_env_handle(lay):
    owner = create_pool(f"pushkv-test-{uuid.uuid4().hex[:8]}", lay, "float32")
    try:
        owner.tensor.view(-1)[:4] = 7.0
        env = {POOL_ENV: handle_to_env(owner.handle)}
        mapped = attach_worker_pool(env, "unused", "decode", 0, lay, "float32", wait_s=1)
        assert mapped.handle == owner.handle and mapped.tensor.view(-1)[:4].tolist() == [7.0] * 4
        mapped.close()
    finally:
        owner.close()
    assert not os.path.exists(owner.handle.name)


def test_a_handle_that_does_not_fit_the_layout_is_refused(lay):
    good = m.PoolHandle("shm", "/nonexistent", L.pool_bytes(lay), "float32", L.pool_shape(lay))
    with pytest.raises(ValueError, match="this layout needs"):
        attach_pool(msgspec.structs.replace(good, nbytes=good.nbytes * 2), lay)
    with pytest.raises(ValueError, match="without its IPC handle"):
        attach_pool(msgspec.structs.replace(good, kind="cuda_ipc", name=""), lay)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        attach_pool(msgspec.structs.replace(good, dtype="int8"), lay)


def test_a_missing_pool_is_named_after_its_wait(lay):
    with pytest.raises(RuntimeError, match="did not appear within 0s"):
        attach_worker_pool({}, f"nodep{uuid.uuid4().hex[:6]}", "decode", 0, lay, "float32", wait_s=0.05)

"""The real etcd server for tests; it lives in ``tools/etcd_server.py`` (the link bench starts one
too). Here ``etcd_server`` skips the test, instead of failing, where etcd is not installed."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from tools.etcd_server import ETCD_BIN, MISSING, EtcdServer, free_port, make_tls
from tools.etcd_server import etcd_server as _etcd_server

__all__ = ["ETCD_BIN", "EtcdServer", "etcd_server", "free_port", "make_tls"]


@contextmanager
def etcd_server(tmp_dir, **kw):
    if not os.path.exists(ETCD_BIN):
        pytest.skip(MISSING)
    with _etcd_server(tmp_dir, **kw) as server:
        yield server

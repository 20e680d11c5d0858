"""When P's writers post from a second agent's thread (transport/poster.py): the auto rule."""
import pytest

from pushkv.transport.poster import wanted


@pytest.mark.parametrize("setting,ucx_tls,want", [
    ("on", "", True),
    ("off", "tcp", False),
    ("auto", "", False),  # UCX picks its lanes: RDMA or CUDA IPC where there are any
    ("auto", "tcp", True),
    ("auto", "tcp,cuda_copy", True),  # the GPU machine's TCP regime: host-staged, the post blocks
    ("auto", "TCP, cuda_copy ,self", True),
    ("auto", "sm,cuda_copy,tcp", True),  # shared memory on the host, TCP for the network
    ("auto", "rc,tcp", False),  # RDMA: posts return at once
    ("auto", "cuda_ipc,cuda_copy,tcp", False),  # the device path
    ("auto", "all", False),
    ("auto", "^cuda_ipc", False),  # an exclusion list: UCX still picks
    ("auto", "cuda_copy", False),  # no network lane named
])
def test_wanted(setting, ucx_tls, want):
    assert wanted(setting, ucx_tls) is want

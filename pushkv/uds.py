"""The router on a Unix domain socket (vLLM's ``--uds``): its URL, checks before it binds, and an HTTP client
connection over it.

A router on a socket is named ``http+unix://`` followed by the socket's path, percent-encoded: the form
``requests-unixsocket`` and ``pushkv status`` read (plain HTTP: local processes only reach it, and HTTPS is the TCP
router's). curl reaches it with
``curl --unix-socket PATH http://localhost/health``. The socket file is made ``0660`` (its owner and group; uvicorn,
which vLLM runs on, makes it ``0666``): on a shared host another user's process may connect only where its user is
in the file's group. The router removes the file when it stops."""
from __future__ import annotations

import http.client
import os
import socket
import stat
import urllib.parse
from typing import Optional

PERMS = 0o660
# sockaddr_un's sun_path: 108 bytes on Linux, the last a NUL
MAX_PATH_BYTES = 107
SCHEME = "http+unix"


def url(path: str) -> str:
    return f"{SCHEME}://{urllib.parse.quote(os.path.abspath(path), safe='')}"


def path_of(u: str) -> Optional[str]:
    """The socket path of an ``http+unix://`` URL (None for another URL)."""
    parts = urllib.parse.urlsplit(u)
    if parts.scheme != SCHEME:
        return None
    return urllib.parse.unquote(parts.netloc)


def check_path(path: str) -> None:
    """Refuse a socket path that cannot be bound, before anything starts: too long, a directory that is not there, or
    a file that is no socket (the router never deletes one)."""
    full = os.path.abspath(path)
    if len(os.fsencode(full)) > MAX_PATH_BYTES:
        raise ValueError(f"--uds {path}: {len(os.fsencode(full))} bytes, over a Unix socket path's "
                         f"{MAX_PATH_BYTES}: choose a shorter path")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise ValueError(f"--uds {path}: the directory {parent} does not exist")
    if os.path.lexists(full) and not stat.S_ISSOCK(os.lstat(full).st_mode):
        raise ValueError(f"--uds {path}: a file that is not a socket is there (it is not removed): choose another "
                         "path")


def _live(path: str) -> bool:
    """Whether a process accepts on the socket file at ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        s.close()
    return True


def check_free(path: str) -> None:
    """``check_path``, and no live process on the socket: what ``pushkv up`` checks before anything starts."""
    check_path(path)
    if os.path.lexists(path) and _live(path):
        raise ValueError(f"--uds {path}: another process is serving on that socket")


def claim(path: str) -> None:
    """Before binding: a socket file left by a router that is gone is removed; one that a live process accepts on
    is refused (binding over it would take another deployment's clients)."""
    check_free(path)
    if os.path.lexists(path):
        os.unlink(path)  # stale: nothing accepts on it


def release(path: str, inode: int) -> None:
    """The socket file removed where it is still the one the router bound (``inode``)."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``http.client`` connection to a router on a Unix socket (the Host header says ``localhost``)."""

    def __init__(self, path: str, timeout: float = 60.0):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.socket_path)
        self.sock = s


def run_dir_socket(run_dir: str) -> str:
    """The router's own socket in the deployment's run dir (0700), for this host's tools (``pushkv status``); "" without
    a run dir."""
    return os.path.join(run_dir, "router.sock") if run_dir else ""

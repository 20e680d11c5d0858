"""A child the supervisor spawns, in a process group of its own, on a terminal of `pushkv up`."""
import os
import pty
import sys
import termios
import time

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.timeout(60)


def _in_terminal_with_tostop() -> None:
    """The pty's side: this process leads the terminal's foreground group, as `pushkv up` run from a shell does, with
    `stty tostop`; it spawns a child as the supervisor spawns each, which logs a line, and says how the child ended."""
    attrs = termios.tcgetattr(0)
    attrs[3] |= termios.TOSTOP
    termios.tcsetattr(0, termios.TCSANOW, attrs)
    sys.path.insert(0, ROOT)
    sys.stderr = sys.__stderr__  # fd 2, the terminal (pytest's capture stands in for it otherwise)
    from pushkv.supervisor import lifecycle

    p = lifecycle.spawn([sys.executable, "-c", "print('child logged', flush=True)"], dict(os.environ))
    end = time.monotonic() + 10
    while p.poll() is None and time.monotonic() < end:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.05)  # polling the child's state in /proc
    os.write(1, f"child: {p.poll()}\n".encode())
    p.kill()
    p.wait()


def test_a_child_logging_to_a_terminal_with_tostop_is_not_stopped():
    """Children got process groups of their own (Ctrl-C reaches the supervisor alone): on a terminal with TOSTOP set
    (`stty tostop`) each child's first log line was a background job's write, and SIGTTOU stopped it (state T); the
    deployment never came up. They ignore SIGTTOU now, so the line is written and the child runs on."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            _in_terminal_with_tostop()
        finally:
            os._exit(0)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # EIO: the pty's side has exited
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    os.close(fd)
    text = out.decode(errors="replace")
    assert "child logged" in text and "child: 0" in text, text

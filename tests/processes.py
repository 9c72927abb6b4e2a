"""What the tests of all three scripts ask about processes: are they alive, whose children are they
(read from Linux's /proc), a deadline so that a test fails instead of hanging, and a terminal to run
a script on and hang up."""

import contextlib
import fcntl
import functools
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail with `TimeoutError` instead of hanging: many tests here check that nothing waits forever."""

    def expire(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state first, then the parent's pid."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        return _stat(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def living(pids) -> list[int]:
    """Those of `pids` that are alive."""
    return [pid for pid in pids if alive(pid)]


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return parents


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [child for child, parent in _parents().items() if parent == pid]


def process_tree(pid: int) -> set[int]:
    """All of `pid`'s descendants: children, their children, and so on."""
    parents, tree, grew = _parents(), set(), True
    while grew:
        new = {child for child, parent in parents.items() if (parent == pid or parent in tree) and child not in tree}
        tree |= new
        grew = bool(new)
    return tree


def in_a_fresh_process(test):
    """Run a test in a pytest process of its own. For a test that starts threads which a later
    `fork` must not inherit: after a video test had resized and encoded frames in the test process
    (OpenCV's thread pool, x264's encoder threads), a ppo_atari worker forked later died at its
    first step."""

    @functools.wraps(test)
    def run_elsewhere(*args, **kwargs):
        if os.environ.get("IN_A_FRESH_PROCESS") == "1":
            return test(*args, **kwargs)
        node_id = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node_id],
                                cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                                env={**os.environ, "IN_A_FRESH_PROCESS": "1"}, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    return run_elsewhere


def on_a_terminal(argv: list[str], hangup=signal.SIG_DFL, **popen_kwargs) -> tuple[subprocess.Popen, int]:
    """`argv` started as a user's program in a terminal window: a session of its own whose controlling
    terminal is a new pseudo-terminal, stdin, stdout and stderr on it. Returns the process and the
    terminal's other end (what the window holds), whose output `read_until` reads; closing it is the
    terminal hanging up, as a closed window or a dropped ssh connection does (the kernel then sends the
    session SIGHUP). `hangup` is what the program starts with for SIGHUP: its default, as a shell starts
    it, whatever the tests run under (`nohup`), or `SIG_IGN` for a program that never hears it (one
    left behind with `& disown`)."""
    window, terminal = pty.openpty()

    def lead_a_session_on_the_terminal():
        os.setsid()
        fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, hangup)

    process = subprocess.Popen(argv, stdin=terminal, stdout=terminal, stderr=terminal,
                               preexec_fn=lead_a_session_on_the_terminal, **popen_kwargs)
    os.close(terminal)
    return process, window


def read_until(window: int, text: str, seconds: float = 120) -> str:
    """What the terminal shows until `text` appears on it; `TimeoutError` after `seconds`."""
    seen, end = b"", time.monotonic() + seconds
    while text.encode() not in seen:
        if not select.select([window], [], [], max(0.0, end - time.monotonic()))[0]:
            raise TimeoutError(f"{text!r} not shown after {seconds} s: {seen.decode(errors='replace')[-2000:]}")
        seen += os.read(window, 65536)
    return seen.decode(errors="replace")


def hang_up(process: subprocess.Popen, window: int, once_shown: str = "step ", seconds: float = 120) -> int:
    """Close the terminal of `on_a_terminal` once it shows `once_shown`; the program's exit status."""
    try:
        read_until(window, once_shown)
        os.close(window)
        return process.wait(timeout=seconds)
    finally:
        process.kill()


def interrupted_while_loading(argv: list[str], directory: Path) -> subprocess.CompletedProcess:
    """`argv`, a script run as from the command line, sent Ctrl-C while its libraries load. They load
    in about a second; here numpy, which each script's libraries import first, is a package (written
    into `directory`, first on the path) that says it is loading, then waits, so the press lands then."""
    (directory / "numpy").mkdir()
    (directory / "numpy" / "__init__.py").write_text(
        "import sys, time\nprint('loading', file=sys.stderr, flush=True)\ntime.sleep(120)\n")
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(directory)})
    try:
        assert process.stderr.readline() == "loading\n"
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=30)
    finally:
        process.kill()
    return subprocess.CompletedProcess(argv, process.returncode, "", errors)

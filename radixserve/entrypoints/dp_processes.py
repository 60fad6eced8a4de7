"""The child processes of `radixserve serve --dp`: the CPU shares, a worker's flags, and a `Child` that is
started pinned, has its output prefixed with its name, and is stopped (or killed) on request."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.server_args import ServerArgs

_PR_SET_PDEATHSIG = 1


_GIVEN_PORTS: set[int] = set()


def free_port(avoid: tuple[int, ...] = ()) -> int:
    """A loopback port that is free now, not in `avoid` and not handed out before by this process.

    NOTE: the kernel may give the same ephemeral port to two binds in a row once the first socket is closed,
    so two workers started one after the other could be told the same port (one then fails to bind). Every
    port handed out is remembered and never handed out again by this process."""
    for _ in range(256):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS and port not in avoid:
            _GIVEN_PORTS.add(port)
            return port
    raise RuntimeError("no free loopback port that was not handed out already")


def core_shares(cores: list[int], n: int) -> list[list[int]]:
    """`cores` cut into n contiguous shares whose sizes differ by at most one."""
    if n < 1:
        raise ValueError(f"the number of workers must be >= 1, got {n}")
    if n > len(cores):
        raise ValueError(f"--dp {n} needs at least {n} CPUs, and this process may use {len(cores)} "
                         f"({','.join(map(str, cores))}); start fewer workers")
    size, extra = divmod(len(cores), n)
    shares, start = [], 0
    for rank in range(n):
        end = start + size + (1 if rank < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


def worker_flags(server_args: ServerArgs, port: int, torch_threads: int) -> list[str]:
    """The `launch_server` flags of one worker: the user's server arguments on a loopback port."""
    worker = server_args.replace(host="127.0.0.1", port=port, torch_threads=torch_threads)
    flags: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(worker, f.name)
        if value == f.default and f.name not in ("host", "port"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _preexec(cores: list[int] | None) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def setup() -> None:
        # NOTE: runs in the child between fork and exec: the worker's threads (torch, OpenMP, its
        # scheduler process) are all created after this, so all of them inherit the CPU share.
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # the child stops if the launcher dies

    return setup


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: str
    cores: list[int] | None

    @classmethod
    def start(cls, name: str, cmd: list[str], env: dict[str, str], cores: list[int] | None, url: str) -> Child:
        # NOTE: a session of its own, so a terminal's Ctrl-C reaches only the launcher, which then stops
        # the gateway before the workers.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_preexec(cores), start_new_session=True)
        threading.Thread(target=_relay, args=(proc, f"[{name}] "), daemon=True).start()
        return cls(name, proc, url, cores)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _relay(proc: subprocess.Popen, prefix: str) -> None:
    assert proc.stdout is not None
    for line in iter(proc.stdout.readline, b""):
        sys.stderr.write(prefix + line.decode(errors="replace"))
        sys.stderr.flush()

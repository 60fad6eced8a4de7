"""`radixserve serve --dp N`: N radixserve workers on this machine behind SGLang's model gateway.

Each worker is an ordinary `python -m radixserve.launch_server` on a loopback port, pinned to its
share of the CPUs (CPU affinity and torch threads; one GPU each where CUDA is used). The gateway
(PyPI `sglang-router`, optional extra `radixserve[router]`) listens on --host/--port and routes with
--router-policy (default cache_aware). Ctrl-C or SIGTERM stops everything together; a worker that
dies is taken out of the gateway's rotation and the others keep serving. docs/scale_out.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from radixserve.entrypoints.dp_processes import Child, core_shares, free_port, worker_flags
from radixserve.mem_cache.kv_events import rank_config_json
from radixserve.server_args import ServerArgs

logger = logging.getLogger("radixserve.dp")

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
INSTALL_HINT = ("`radixserve serve --dp N` runs SGLang's model gateway in front of the workers, and it is not "
                "installed here. Install it with:  pip install 'radixserve[router]'   "
                "(or: pip install sglang-router==0.3.2)")
STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 20.0
# NOTE: the gateway's defaults notice a dead worker after 3 failed health checks 60 s apart and open its
# circuit after 10 failures; with these its circuit opens after 2 failed attempts, so a request that met it
# is retried (the gateway retries up to 5 times) on the survivor, and health checks drop it within ~4 s.
# The launcher also removes a worker it sees exit at once (DPLauncher.supervise).
GATEWAY_FAULT_ARGS = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                      "--health-success-threshold", "1", "--cb-failure-threshold", "2",
                      "--cb-timeout-duration-secs", "30", "--worker-startup-timeout-secs", "60",
                      "--shutdown-grace-period-secs", "10")


@dataclass(frozen=True)
class DPConfig:
    dp_size: int
    router_policy: str = "cache_aware"
    router_log_level: str = "warn"
    router_extra_args: tuple[str, ...] = ()


def add_dp_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallelism (N workers behind SGLang's model gateway)")
    group.add_argument("--dp", type=int, default=1,
                       help="workers on this machine, each pinned to its share of the CPUs, behind the gateway on "
                            "--host/--port; needs `pip install 'radixserve[router]'` (default: %(default)s, one server)")
    group.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                       help="the gateway's routing policy with --dp (default: %(default)s)")
    group.add_argument("--router-log-level", default="warn", choices=("debug", "info", "warn", "error"),
                       help="the gateway's log level with --dp (default: %(default)s)")
    group.add_argument("--router-extra-args", default="",
                       help="more sglang-router flags with --dp, one string, e.g. \"--cache-threshold 0.5\" "
                            "(default: none)")


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def run_dp(args: argparse.Namespace) -> None:
    """`radixserve serve --dp N`: runs until Ctrl-C / SIGTERM, or until no worker is left."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s dp] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    if args.dp < 1:
        sys.exit(f"--dp must be >= 1, got {args.dp}")
    config = DPConfig(args.dp, args.router_policy, args.router_log_level, tuple(shlex.split(args.router_extra_args)))
    if not router_installed():
        sys.exit(INSTALL_HINT)
    server_args = ServerArgs.from_cli_args(args)
    http_flags = ["--max-body-bytes", str(args.max_body_bytes), "--health-timeout", str(args.health_timeout),
                  "--heartbeat-interval", str(args.heartbeat_interval)]
    launcher = DPLauncher(server_args, config, http_flags)
    sys.exit(launcher.run())


class DPLauncher:
    """Starts the workers, then the gateway; supervises them; stops them all together."""

    def __init__(self, server_args: ServerArgs, config: DPConfig, http_flags: list[str]) -> None:
        if config.dp_size < 1:
            raise ValueError(f"--dp must be >= 1, got {config.dp_size}")
        self.server_args = server_args
        self.config = config
        self.http_flags = http_flags
        self.workers: list[Child] = []
        self.gateway: Child | None = None
        self._stop = threading.Event()

    @property
    def gateway_url(self) -> str:
        host = "127.0.0.1" if self.server_args.host in ("0.0.0.0", "::", "") else self.server_args.host
        return f"http://{host}:{self.server_args.port}"

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        try:
            self.start_workers()
            self.wait_workers_healthy()
            self.start_gateway()
            self.wait_gateway_ready()
            logger.info("serving on http://%s:%d: %d radixserve workers behind SGLang's model gateway "
                        "(policy %s); Ctrl-C stops all", self.server_args.host, self.server_args.port,
                        len(self.workers), self.config.router_policy)
            return self.supervise()
        except KeyboardInterrupt:
            return 0
        except (RuntimeError, TimeoutError, ValueError) as e:
            logger.error("%s", e)
            return 1
        finally:
            self.stop_all()
            signal.signal(signal.SIGTERM, previous)

    # ------------------------------------------------------------------------------ start

    def start_workers(self) -> None:
        shares = core_shares(sorted(allowed_cpus()), self.config.dp_size)
        gpus = _gpu_ids(self.server_args.device, self.config.dp_size)
        shared = shared_storage_args(self.server_args)
        if shared.enable_hierarchical_cache:
            logger.info("the workers share one hierarchical cache storage directory: %s", shared.hicache_storage_dir)
        for rank, cores in enumerate(shares):
            port = free_port(avoid=(self.server_args.port,))  # the gateway binds that one later
            threads = self.server_args.torch_threads or len(cores)
            # NOTE: each worker publishes its KV events on its own port (the configured one + its rank), as SGLang's
            worker = shared.replace(kv_events_config=rank_config_json(shared.kv_events_config, rank))
            args = worker_flags(worker, port, threads) + self.http_flags
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
            cmd = [sys.executable, "-m", "radixserve.launch_server", *args]
            self.workers.append(Child.start(f"worker {rank}", cmd, env, cores, f"http://127.0.0.1:{port}"))
            logger.info("worker %d: %s, CPUs [%s], torch threads %d%s", rank, self.workers[-1].url,
                        _cpu_list(cores), threads, "" if gpus is None else f", GPU {gpus[rank % len(gpus)]}")

    def wait_workers_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = list(self.workers)
        while pending:
            self._check_stop()
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} while starting")
                if _status(child.url + "/health") == 200:
                    logger.info("%s ready", child.name)
                    pending.remove(child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not healthy after {STARTUP_TIMEOUT_S:.0f} s: "
                                   f"{', '.join(c.name for c in pending)}")
            time.sleep(0.2)

    def start_gateway(self) -> None:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.server_args.host,
               "--port", str(self.server_args.port), "--worker-urls", *[w.url for w in self.workers],
               "--policy", self.config.router_policy, "--log-level", self.config.router_log_level,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port(avoid=(self.server_args.port,))),
               *GATEWAY_FAULT_ARGS, *self.config.router_extra_args]
        self.gateway = Child.start("gateway", cmd, dict(os.environ), None, self.gateway_url)
        logger.info("gateway: %s", " ".join(shlex.quote(c) for c in cmd[1:]))

    def wait_gateway_ready(self) -> None:
        assert self.gateway is not None
        deadline = time.monotonic() + 120.0
        while self.healthy_in_gateway() < len(self.workers):
            self._check_stop()
            if self.gateway.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with code {self.gateway.proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not register every worker within 120 s")
            time.sleep(0.2)

    def healthy_in_gateway(self) -> int:
        try:
            body = httpx.get(self.gateway_url + "/readiness", timeout=2.0).json()
            return int(body.get("healthy_workers", 0))
        except (httpx.HTTPError, ValueError, AttributeError):
            return 0

    # ------------------------------------------------------------------------------ supervise, stop

    def supervise(self) -> int:
        assert self.gateway is not None
        alive = set(range(len(self.workers)))
        while not self._stop.wait(0.5):
            if self.gateway.proc.poll() is not None:
                logger.error("the gateway exited with code %s; stopping the workers", self.gateway.proc.returncode)
                return 1
            for rank in sorted(alive):
                child = self.workers[rank]
                if child.proc.poll() is not None:
                    alive.discard(rank)
                    logger.warning("%s (%s) exited with code %s; taking it out of the gateway's rotation, %d "
                                   "worker(s) left", child.name, child.url, child.proc.returncode, len(alive))
                    self.remove_from_gateway(child.url)
            if not alive:
                logger.error("no worker left; stopping")
                return 1
        return 0

    def remove_from_gateway(self, url: str) -> bool:
        """DELETE the worker from the gateway's registry (its health checks would also notice, later)."""
        try:
            workers = httpx.get(self.gateway_url + "/workers", timeout=5.0).json().get("workers", [])
            ids = [w["id"] for w in workers if w.get("url") == url]
            for worker_id in ids:
                httpx.delete(f"{self.gateway_url}/workers/{worker_id}", timeout=5.0)
            return bool(ids)
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
            logger.warning("could not remove %s from the gateway (%s); its health checks will", url, e)
            return False

    def stop_all(self) -> None:
        """Gateway first (no new requests), then the workers; whatever outlives the grace period is killed."""
        children = ([self.gateway] if self.gateway else []) + self.workers
        for child in children:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.wait_or_kill(max(0.1, deadline - time.monotonic()))
        if children:
            logger.info("stopped %d worker(s)%s", len(self.workers), " and the gateway" if self.gateway else "")

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise KeyboardInterrupt


def shared_storage_args(server_args: ServerArgs) -> ServerArgs:
    """`server_args` with the disk tier's directory made absolute and explicit, so every worker of `--dp N` opens
    the same one (its default, hicache/ under RADIXSERVE_CACHE_DIR, is resolved once here).

    NOTE: the file backend is safe for several processes over one directory (docs/hicache.md, "Across workers")."""
    if not server_args.enable_hierarchical_cache or server_args.hicache_storage_backend != "file":
        return server_args
    from radixserve import envs  # NOTE: light (no torch): the launcher never loads torch

    directory = server_args.hicache_storage_dir or os.path.join(str(envs.CACHE_DIR.get()), "hicache")
    return server_args.replace(hicache_storage_dir=os.path.abspath(os.path.expanduser(directory)))


def allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _gpu_ids(device: str, n: int) -> list[str] | None:
    """The GPUs to hand out one per worker, or None when the workers run on the CPU."""
    if device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g for g in visible.split(",") if g.strip()]
    else:
        ids = [str(i) for i in range(_cuda_device_count())]
    if not ids:
        return None
    if len(ids) < n:
        logger.warning("%d workers share %d GPU(s)", n, len(ids))
    return ids


def _cuda_device_count() -> int:
    # NOTE: asked in a child process, so the launcher itself never loads torch (or holds a CUDA context).
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0


def _cpu_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return 0

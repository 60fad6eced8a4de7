"""`python -m radixserve.launch_server [server args]` (also `radixserve serve`): the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from radixserve.frontend.tokenizer_manager import FrontendConfig
from radixserve.server_args import ServerArgs

_DEFAULTS = FrontendConfig()


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerArgs flag plus the HTTP-only ones; `radixserve serve` registers the same."""
    ServerArgs.add_cli_args(parser)
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                       help=f"largest request body; larger ones get 413 (default: {_DEFAULTS.max_body_bytes})")
    group.add_argument("--health-timeout", type=float, default=_DEFAULTS.health_timeout_s,
                       help="seconds without an answer from the scheduler before /health fails "
                            f"(default: {_DEFAULTS.health_timeout_s})")
    group.add_argument("--heartbeat-interval", type=float, default=_DEFAULTS.heartbeat_interval_s,
                       help=f"seconds between scheduler liveness probes (default: {_DEFAULTS.heartbeat_interval_s})")
    group.add_argument("--max-scheduler-restarts", type=int, default=_DEFAULTS.max_scheduler_restarts,
                       help="scheduler restarts allowed within --scheduler-restart-window; one more death "
                            f"and the server exits with status 1 (default: {_DEFAULTS.max_scheduler_restarts})")
    group.add_argument("--scheduler-restart-window", type=float, default=_DEFAULTS.restart_window_s,
                       help=f"seconds over which restarts are counted (default: {_DEFAULTS.restart_window_s})")


def run_serve(args: argparse.Namespace) -> None:
    from radixserve.entrypoints.http_server import launch_server

    server_args = ServerArgs.from_cli_args(args)
    config = FrontendConfig.from_server_args(
        server_args, max_body_bytes=args.max_body_bytes, health_timeout_s=args.health_timeout,
        heartbeat_interval_s=args.heartbeat_interval, max_scheduler_restarts=args.max_scheduler_restarts,
        restart_window_s=args.scheduler_restart_window)
    launch_server(server_args, config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve serve",
                                     description="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    add_serve_args(parser)
    run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()

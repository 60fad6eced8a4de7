"""The scheduler child process of the HTTP server: model runner + Scheduler behind two ZMQ sockets.

The HTTP process binds a PUSH socket (requests) and a PULL socket (outputs); the child connects a
PULL and a PUSH to them. Messages are pickled io_struct objects. A receiver thread in the child moves
requests into `scheduler.input_queue`; the scheduler's `output_sink` pushes its outputs
(`BatchTokenIDOut`, `FlushCacheOut`, `GetInternalStateOut`) back. Once the model is loaded the
child sends a `SchedulerInfo` (tokenizer included) through a pipe, so the HTTP process tokenizes with
exactly the tokenizer the model was loaded with and never loads weights itself.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from radixserve.protocol.scheduler_info import PortArgs, SchedulerInfo
from radixserve.server_args import ServerArgs

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


class _ZmqSink:
    """The scheduler's `output_sink`: pickles each output onto the PUSH socket."""

    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._lock = threading.Lock()  # NOTE: ZMQ sockets are not thread-safe

    def __call__(self, out: Any) -> None:
        with self._lock:
            self._socket.send_pyobj(out)


def _forward_requests(socket: Any, input_queue: Any) -> None:
    import zmq

    while True:
        try:
            msg = socket.recv_pyobj()
        except zmq.ZMQError:
            return
        input_queue.put(msg)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)  # the HTTP process is gone; nobody can read our outputs


def build_scheduler(server_args: ServerArgs, output_sink: Any, loaded_model: Any = None) -> tuple[Any, SchedulerInfo]:
    """Loads the model and builds the Scheduler around it: the one bootstrap of both front ends (the server's
    child process and the offline Engine's thread). `loaded_model` reuses weights already in memory."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.model_executor.cpu_threads import build_on_short_lived_thread
    from radixserve.model_executor.model_runner import ModelRunner

    runner = build_on_short_lived_thread(ModelRunner, server_args, loaded_model)
    scheduler = build_on_short_lived_thread(Scheduler, server_args, model_runner=runner, output_sink=output_sink)
    return scheduler, _info_from_runner(server_args, runner)


def _info_from_runner(server_args: ServerArgs, runner: ModelRunner) -> SchedulerInfo:
    config = runner.model_config
    name = server_args.served_model_name or runner.loaded.name or _name_from_path(server_args.model_path)
    eos = config.eos_token_ids or ()
    return SchedulerInfo(
        model_name=str(name),
        tokenizer=runner.tokenizer,
        context_len=int(runner.context_len),
        vocab_size=int(config.vocab_size),
        eos_token_ids=tuple(int(t) for t in eos),
        max_total_num_tokens=int(runner.max_total_num_tokens),
        page_size=int(runner.page_size),
        max_running_requests=int(runner.max_running_requests),
        dtype=str(runner.dtype).replace("torch.", ""),
        device=str(runner.device),
        pid=os.getpid(),
        platform=runner.platform_info(),
        lora_enabled=getattr(runner, "lora", None) is not None,
        hidden_size=int(config.hidden_size),
    )


def _name_from_path(model_path: str | None) -> str:
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model_path))
    return base.rsplit(".gguf", 1)[0] if base.endswith(".gguf") else base


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, ready: Connection) -> None:
    """Entry point of the child: load, report ready (or the error), then run the event loop forever."""
    import zmq

    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s scheduler] %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    context = zmq.Context()
    requests = context.socket(zmq.PULL)
    requests.connect(port_args.request_endpoint)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 0)
    outputs.connect(port_args.output_endpoint)
    try:
        scheduler, info = build_scheduler(server_args, _ZmqSink(outputs))
    except BaseException:
        ready.send({"error": traceback.format_exc()})
        raise
    ready.send({"info": info})
    threading.Thread(target=_forward_requests, args=(requests, scheduler.input_queue), daemon=True).start()
    try:
        scheduler.event_loop()
    except BaseException:
        logger.exception("scheduler event loop crashed")
        os._exit(1)


def launch_scheduler_process(server_args: ServerArgs, port_args: PortArgs,
                             timeout_s: float = 600.0) -> tuple[mp.Process, SchedulerInfo]:
    """Spawns the child and waits until its model is loaded; raises with the child's traceback on failure."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, args=(server_args, port_args, writer),
                       name="radixserve-scheduler", daemon=True)
    proc.start()
    writer.close()
    deadline = time.monotonic() + timeout_s
    while not reader.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"scheduler process exited with code {proc.exitcode} before it was ready")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"scheduler process not ready after {timeout_s:.0f} s")
    try:
        message = reader.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"scheduler process exited with code {proc.exitcode} before it was ready") from None
    if "error" in message:
        proc.join(5)
        raise RuntimeError("scheduler process failed to start:\n" + message["error"])
    return proc, message["info"]

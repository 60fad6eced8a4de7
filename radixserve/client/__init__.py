"""The scheduler's client, shared by both front ends: the offline `Engine` (in-process, threads) and the
HTTP server's `TokenizerManager` (ZMQ, asyncio).

What a front end does with the scheduler is written once here, in `SchedulerClient` (scheduler_client.py) over a
transport; each front end adds only its transport and its concurrency: `request_state.py` (a request in flight,
the state both extend), `tracker.py` (requests in flight and the routing of output records), `replies.py` (control
messages answered in order), `shaping.py` (SGLang's native logprob shape) and `text_stream.py` (incremental text).
What a request may be, and the message per choice, are `protocol/requests.py`'s.
"""

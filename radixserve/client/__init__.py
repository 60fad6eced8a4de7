"""The scheduler's client, shared by both front ends: the offline `Engine` (in-process, threads) and the
HTTP server's `TokenizerManager` (ZMQ, asyncio).

What a front end does with the scheduler is written once here; each front end adds only its transport
and its concurrency: `requests.py` (what a request may be, one message per choice), `tracker.py`
(requests in flight and the routing of output records), `replies.py` (control messages answered in
order) and `shaping.py` (SGLang's native logprob shape).
"""

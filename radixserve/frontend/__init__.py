"""The HTTP process's side of the server: the scheduler's client over ZMQ (`TokenizerManager`), fair admission
and fair CPU work, request bounds, tenant namespaces, the link to the scheduler process and its supervisor.
The scheduler process's code is in `radixserve/managers/`; what both front ends share is `radixserve/client/`.
"""

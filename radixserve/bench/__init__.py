"""`radixserve bench`: the scheduler's reference workloads (W1 shared prefix, W2 no sharing, W3 multi-turn).

`workloads` builds them as token ids + text, backend-independent; `runner` replays them through a
`Backend` (the in-process Engine here; an HTTP client can implement the same protocol).
"""

"""What crosses the process boundary between the front ends and the scheduler: the request and response
messages (io_struct) and the rules every request must meet (requests: limits, the one length rule, check_request)."""

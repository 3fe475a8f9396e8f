"""Development tools for tests, perf scripts and the GPU-node script: free ports, waits, processes.

Not part of the portal: nothing under portal/ or inference/ imports it. It uses only the standard
library (httpx is imported inside `wait_for_http`, the one function that needs it), so a script
carried to a bare machine with the repository can use it.
"""

from devtools.ports import free_port
from devtools.processes import children_of, log_tail, spawn, stop, stop_all
from devtools.waiting import NotReady, wait_for_http, wait_for_tcp, wait_until

__all__ = [
    "NotReady",
    "children_of",
    "free_port",
    "log_tail",
    "spawn",
    "stop",
    "stop_all",
    "wait_for_http",
    "wait_for_tcp",
    "wait_until",
]

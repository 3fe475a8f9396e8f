"""One runner for every long job: a claim, a lease renewed while working, and a fencing token.

The job's own row carries the lease (`LeasedJob`, an abstract model its app's model inherits), so
the row a job writes is the row that fences it. `claim` takes a free or lapsed lease and bumps the
token; `Lease.fenced()` locks the row, checks the token is still ours and only then lets the job
write (its own row and the rows that hang off it); `Lease.finish` ends it. docs/jobs.md.
"""

from .lease import Lease, LostLease, before_fenced_writes, claim, lease_break, lease_free, worker_name

__all__ = [
    "Lease",
    "LostLease",
    "before_fenced_writes",
    "claim",
    "lease_break",
    "lease_free",
    "worker_name",
]

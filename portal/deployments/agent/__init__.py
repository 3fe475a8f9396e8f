"""What runs on a GPU node: the agent's half of a deployment, one module per job.

The tasks in `portal/deployments/tasks.py` are sent to `node.<name>` (`portal/deployments/dispatch.py`)
and call these, because they start and signal local processes. Every action first takes the
deployment's lease (docs/concurrency.md): a second task for the same deployment, run twice or
concurrently, finds the lease taken and does nothing, and an agent that lost its lease (it
stalled past the expiry and another agent took over) is fenced out: its writes match no row and
it stops what it launched.

- `lease.py`: the deployment's lease (the job runner's, `portal/core/jobs`) and the agent's owner name
- `steps.py`: the timeline (events, timed steps, `StepFailed`)
- `environment.py`: what the node gives a server: Python and kernels, model files, addresses, port
- `start.py`: validate → quota → environment → hashes → port → launch → ready → warm-up → smoke test
- `stop.py`: drain, stop the process group, free the port; stop every server of the node
- `restart.py`: an operator's restart (stop and start under one lease)
- `restart_policy.py`: automatic restarts: crash backoff and limit, planned restarts
- `supervise.py`: the periodic pass over the node's deployments (health, samples, log rotation)
- `adopted.py`: health checks of servers the portal did not start
"""

"""Benchmarks of OpenAI-compatible servers: workloads, the load generator, metrics, the SLA point.

Pure Python (no Django). The portal's benchmark jobs, the `bench` command and the
simulator's virtual-clock mode all use these same modules, so a number means the
same thing wherever it was produced.
"""

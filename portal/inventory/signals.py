"""What inventory tells the apps above it, without knowing who listens.

`gpus_sick` is sent (with `node=`) by a GPU health sample that finds a degraded or lost GPU on the
node; deployments drains the deployments holding them (portal/deployments/signals.py). A signal,
because inventory sits below deployments and names none of its tasks.
"""

from __future__ import annotations

from django.dispatch import Signal

gpus_sick = Signal()

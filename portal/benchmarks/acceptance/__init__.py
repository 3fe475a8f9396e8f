"""Node acceptance ("burn-in"): is this node as fast as the simulator says a node like it is?

Its home. Here, one module per job:

- `request.py`: the staff button and `manage.py accept_node` ask (`node_acceptance_request`: check
  the options, claim the node, send `benchmarks.accept_node` to its agent); expiring abandoned ones;
- `run.py`: the run on the node (`node_acceptance_run`), the steps in `steps.py`, the fenced record
  and the typed context in `record.py`; `feature_probe.py`: with a profile (`--profile`) that turns
  them on, chunked prefill and prefix caching asked for on purpose (no Django);
  `judging.py`: measured vs predicted, the verdict (pure);
- `options.py`: what may be asked (a profile's launch flags too) and the names of what it makes;
- `views.py`, `forms.py`, `plots.py`, `selectors.py`: *Accept this node* and the acceptance section
  of the node's page (portal/benchmarks/node_views.py).

Elsewhere, each for a reason of layers: the stored record `NodeAcceptance` and the calibration it
keeps (`node_latest_calibration`) live in `portal/inventory` (models.py, selectors.py), because the
simulator below benchmarks reads them; the fit itself is `calibrate_sweep` in
portal/deployments/predict.py; the Celery tasks are portal/benchmarks/tasks.py (found by
autodiscovery) and the command portal/benchmarks/management/commands/accept_node.py.
"""

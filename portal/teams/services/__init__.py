"""Writes for teams, one module per sub-domain (HackSoft: a services package).

- `keys.py`: API keys (create, member keys, new secrets, revoke) and how a key is checked;
- `teams.py`: teams themselves;
- `usage_queue.py`: the usage flush from Redis into the database, its Lua and dead letters;
- `rollups.py`: hourly and daily usage rollups;
- `retention.py`: the usage table's day partitions and the prune of old days;
- `budgets.py`: daily token budgets;
- `blocks.py`: the gateway's block list (revoked keys, spent budgets).

The public names are re-exported here: callers import `portal.teams.services` as before. A
test or script that replaces a function for the flush to call patches the module that calls
it (`services.usage_queue`), not this package.
"""

from .blocks import gateway_block
from .budgets import budgets_enforce
from .keys import (
    KEY_SCHEME,
    api_key_create,
    api_key_digest,
    api_key_hmac_secret,
    api_key_matches,
    api_key_new_secret,
    api_key_prefix,
    api_key_revoke,
    member_key_for,
)
from .retention import usage_partitions_maintain, usage_prune
from .rollups import usage_rollup, usage_rollup_daily, usage_rollup_hours, usage_rollup_recent
from .teams import team_create
from .usage_queue import (
    DeadLetterReplay,
    usage_dead_letters_purge,
    usage_dead_letters_replay,
    usage_flush,
    usage_insert,
)

__all__ = [
    "KEY_SCHEME",
    "DeadLetterReplay",
    "api_key_create",
    "api_key_digest",
    "api_key_hmac_secret",
    "api_key_matches",
    "api_key_new_secret",
    "api_key_prefix",
    "api_key_revoke",
    "budgets_enforce",
    "gateway_block",
    "member_key_for",
    "team_create",
    "usage_dead_letters_purge",
    "usage_dead_letters_replay",
    "usage_flush",
    "usage_insert",
    "usage_partitions_maintain",
    "usage_prune",
    "usage_rollup",
    "usage_rollup_daily",
    "usage_rollup_hours",
    "usage_rollup_recent",
]

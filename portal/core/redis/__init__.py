"""The portal's Redis mechanism, in one home.

- `client`: the one client factory (sync and asyncio, plain, TLS or Sentinel) and this
  installation's `RedisKeys`;
- `keys`: every key name, under the installation's namespace;
- `scripts`: the call-record machinery of Lua scripts (KEYS and ARGV by name, Redis's clock) and
  the scripts of the apps below the gateway (the usage flush, the dashboard's maxima).

The gateway's admission (quotas, blocks, replica slots, queues, leases), its scripts and its
pipelined connection are the gateway's: portal/gateway/admission/.

Nothing here imports at package level: `portal/settings.py` reads `keys` before Django is set up.
"""

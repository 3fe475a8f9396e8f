"""The portal's Redis infrastructure, in one home.

- `client`: the one client factory (sync and asyncio, plain, TLS or Sentinel) and this
  installation's `RedisKeys`;
- `keys`: every key name, under the installation's namespace;
- `scripts`: every Lua script, with the layout of its KEYS and ARGV;
- `ratelimit`: the gateway's admission (quotas, blocks, replica slots, queues) on those scripts.

Nothing here imports at package level: `portal/settings.py` reads `keys` before Django is set up.
"""

"""The playground's pipeline tests run the gateway's own uvicorn process and fake upstream."""

from tests.gateway.conftest import fake_upstream, gateway, gw_redis, serving  # noqa: F401

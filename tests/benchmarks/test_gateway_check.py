"""The benchmarks worker says at start whether BENCHMARK_GATEWAY_URL reaches this portal's gateway."""

from __future__ import annotations

import socket

import pytest

from portal.benchmarks.services.gateway_check import benchmark_gateway_check

pytestmark = [pytest.mark.django_db(transaction=True)]


def test_it_finds_this_portals_gateway_answering_at_its_url(gateway):
    result = benchmark_gateway_check(gateway.url)
    assert result.answers, result.detail


def test_it_says_nothing_answers_at_a_port_no_one_serves():
    with socket.socket() as probe:  # a free port, closed again before the check
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = benchmark_gateway_check(f"http://127.0.0.1:{port}")
    assert not result.answers
    assert f"nothing answers at http://127.0.0.1:{port}" in result.detail


def test_it_says_a_server_that_is_not_the_gateway_is_not_it(fake_upstream):
    result = benchmark_gateway_check(fake_upstream)
    assert not result.answers
    assert "not this portal's gateway" in result.detail

"""Scraping the portal's /metrics in tests."""

from __future__ import annotations

TOKEN = "s3cret-metrics-token"


def scrape(client, token: str = TOKEN) -> dict[tuple, float]:
    """GET /metrics and parse it: (sample name, sorted labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)

"""Reading a hub's /metrics as Prometheus does."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = list[tuple[str, dict[str, str], float]]


def scrape(client: httpx.Client) -> tuple[dict[str, str], Samples]:
    """The metric families (name -> type) and every sample of /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, []
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        samples += [(s.name, s.labels, s.value) for s in family.samples]
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())

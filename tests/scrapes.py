"""The scheduler's ``/metrics`` as Prometheus reads it (``from scrapes import scrape, value``):
fetched over HTTP, parsed with ``prometheus_client``'s own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PREFIX = "dask_antdt_"


def scrape(dashboard: str) -> list[Sample]:
    """The ``dask_antdt_*`` samples the scheduler whose dashboard is at ``dashboard``
    (``http://host:port``, any path after it is ignored) serves on ``/metrics`` now."""
    root = "/".join(dashboard.split("/")[:3])
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text)
            if family.name.startswith(PREFIX) for sample in family.samples]


def value(samples: list[Sample], series: str, **labels: str) -> float | None:
    """The value of the sample ``dask_antdt_<series>`` whose labels include ``labels`` (None:
    there is none); more than one such sample is an error."""
    found = [s.value for s in samples if s.name == PREFIX + series
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{len(found)} samples of {series} with {labels}"
    return found[0] if found else None

"""Prometheus series that all carry the same leading labels, on one registry.

An engine's series all carry ``model_name`` and ``engine`` (vLLM's labels), and most are
used with those two set and nothing else: :class:`LabeledSeries` creates each series with
the shared labels (plus any of its own) and hands back the child for the shared values,
or one child per known value of the series' own label.

Imports prometheus_client only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class LabeledSeries:
    """Creates series on ``registry`` whose leading labels ``names`` take the values ``values``
    (without ``values``, only :meth:`family`: the caller labels every child)."""

    def __init__(self, registry: CollectorRegistry, names: Sequence[str], values: Sequence[str] = ()) -> None:
        self.registry = registry
        self.names = list(names)
        self.values = tuple(values)

    def family(self, cls: type[M], name: str, doc: str, *labels: str, **kwargs: Any) -> M:
        """The parent series with the shared labels then ``labels`` (children made by the caller)."""
        return cls(name, doc, [*self.names, *labels], registry=self.registry, **kwargs)

    def child(self, family: M, *values: str) -> M:
        """``family``'s child for the shared values then ``values``."""
        return family.labels(*self.values, *values)

    def each(self, cls: type[M], name: str, doc: str, label: str, keys: Iterable[str], **kwargs: Any) -> dict[str, M]:
        """One child per key of the series' own ``label``, created up front so each rate exists from the start."""
        family = self.family(cls, name, doc, label, **kwargs)
        return {key: self.child(family, key) for key in keys}

    def counter(self, name: str, doc: str) -> Counter:
        """A counter with the shared labels alone, as its child for the shared values."""
        return self.child(self.family(Counter, name, doc))

    def gauge(self, name: str, doc: str) -> Gauge:
        """A gauge with the shared labels alone, as its child for the shared values."""
        return self.child(self.family(Gauge, name, doc))

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        """A histogram with the shared labels alone, as its child for the shared values."""
        return self.child(self.family(Histogram, name, doc, buckets=buckets))

"""The standalone router's index of which replica serves which model (pure, no HTTP)."""

from __future__ import annotations

from prefixserve.router.standalone.served_models import ServedModels


def test_a_model_goes_to_the_replicas_listing_it_and_to_those_not_read_yet() -> None:
    models = ServedModels(["a", "b", "c"])
    assert not models and models.among("m") is None
    models.set("b", [{"id": "m1"}, {"id": "m2"}])
    models.set("a", [{"id": "m1"}])
    assert models and "a" in models and "c" not in models
    assert models.among("m1") == ["a", "b", "c"]
    assert models.among("m2") == ["b", "c"]  # c's list is not read: it may serve m2
    assert models.among("nope") is None
    models.set("c", [{"id": "m1"}])
    assert models.among("m2") == ["b"]
    models.drop("b")  # back from the dead: read again before it counts
    assert models.among("m2") is None and models.among("m1") == ["a", "b", "c"]


def test_adapters_and_prefixserve_replicas_are_known_from_their_entries() -> None:
    models = ServedModels(["a", "b"])
    models.set("a", [{"id": "base", "owned_by": "prefixserve"}, {"id": "sql", "parent": "base"}])
    models.set("b", [{"id": "base", "owned_by": "vllm"}])
    assert models.is_adapter("sql") and not models.is_adapter("base")
    assert models.speaks_prefixserve("a") and not models.speaks_prefixserve("b")
    assert [e["id"] for e in models.merged()] == ["base", "sql"]
    assert models.merged()[0]["owned_by"] == "prefixserve"  # the first replica's entry
    models.set("a", [{"id": "base"}])
    assert not models.is_adapter("sql") and not models.speaks_prefixserve("a")

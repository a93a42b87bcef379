"""The Serve deployment's vLLM-format KV events: every replica gets one engine config, so each moves
its publisher's endpoints by its rank (replica/entrypoints/serve/deployment.py kv_events_for_rank)."""

from __future__ import annotations

from prefixserve.replica.config import EngineConfig
from prefixserve.replica.entrypoints.serve.deployment import kv_events_for_rank

EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}'


def test_each_rank_publishes_on_its_own_ports():
    config = EngineConfig(kv_events_config=EVENTS)
    assert kv_events_for_rank(config, None) is config
    assert kv_events_for_rank(config, 0) is config
    events = kv_events_for_rank(config, 2).kv_events
    assert events is not None
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5559", "tcp://*:5602")


def test_without_events_the_config_is_unchanged():
    config = EngineConfig()
    assert kv_events_for_rank(config, 3) is config
    off = EngineConfig(kv_events_config='{"enable_kv_cache_events": false}')
    assert kv_events_for_rank(off, 3) is off

"""bench_flow's pure parts: the tenant file, the open-loop schedule, and the figures of a phase."""

from __future__ import annotations

from prefixserve.loadtest import bench_flow as bf
from prefixserve.loadtest.harness.client import RequestRecord
from prefixserve.router.cluster_config import AppArgs
from prefixserve.router.flow_control.tenants import tenants_from_data


def _record(
    i: int, sent: float, ended: float, *, status: int = 200, ttft: float = 0.1, tokens: int = 10
) -> RequestRecord:
    ok = status == 200
    return RequestRecord(
        index=i,
        ok=ok,
        status=status,
        replica="r",
        sent_s=sent,
        first_token_s=sent + ttft if ok else None,
        ended_s=ended,
        prompt_tokens=tokens if ok else None,
        completion_tokens=0 if ok else None,
        error=None if ok else f"HTTP {status}",
    )


def test_the_tenant_file_and_the_deployment_are_valid() -> None:
    table = tenants_from_data(bf.tenant_file(30.0))
    assert {t.name: t.default_priority for t in table.tenants} == bf.TENANT_BANDS
    assert table.by_name(bf.NOISY).requests_per_minute == 30.0  # type: ignore[union-attr]
    args = AppArgs.from_dict(bf.app_args("m", 2, 4, bf.tenant_file(30.0), 120.0, reserved_slots=2))
    assert args.flow_max_in_flight() == 8 and args.ingress.config.queue_budget_s == 120.0
    assert args.engine["max_num_seqs"] == 8 and args.ingress.config.flow_reserved_slots == 2
    plain = AppArgs.from_dict(bf.app_args("m", 2, 4, None, 120.0))
    assert plain.ingress.config.tenants is None and plain.engine["max_num_seqs"] == 4


def test_schedule_is_seeded_poisson_per_tenant() -> None:
    arrivals = bf.schedule({bf.INTERACTIVE: 2.0, bf.BATCH: 8.0}, 50.0, "m", seed=3)
    assert arrivals == bf.schedule({bf.INTERACTIVE: 2.0, bf.BATCH: 8.0}, 50.0, "m", seed=3)
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    counts = {t: sum(a.tenant == t for a in arrivals) for t in (bf.INTERACTIVE, bf.BATCH)}
    assert 70 <= counts[bf.INTERACTIVE] <= 130 and 330 <= counts[bf.BATCH] <= 470
    batch = next(a for a in arrivals if a.tenant == bf.BATCH).body
    assert batch["max_tokens"] == bf.BATCH_SHAPE.max_tokens and batch["ignore_eos"]
    systems = {a.body["messages"][0]["content"] for a in arrivals if a.tenant == bf.BATCH}
    assert len(systems) == 1  # a tenant's requests share its prefix


def test_summaries_jain_and_the_admitted_rate() -> None:
    records = [
        bf.TenantRecord(bf.BATCH_A, _record(0, 0.0, 1.0, ttft=0.2)),
        bf.TenantRecord(bf.BATCH_A, _record(1, 5.0, 6.0, ttft=0.4)),
        bf.TenantRecord(bf.BATCH_B, _record(2, 0.0, 2.0)),
        bf.TenantRecord(bf.BATCH_B, _record(3, 4.0, 30.0)),  # ended after A's last send: not counted
        bf.TenantRecord(bf.NOISY, _record(4, 1.0, 1.5)),
        bf.TenantRecord(bf.NOISY, _record(5, 2.0, 2.0, status=429)),
    ]
    summary = bf.summarize(records)
    assert summary[bf.BATCH_A].ttft_p50_s is not None and summary[bf.BATCH_A].ok == 2
    assert summary[bf.NOISY].refused == {"429": 1} and summary[bf.NOISY].tokens == 10
    # Both backlogged until t=4 (B's last send): A served 10 tokens by then, B 10.
    assert bf.backlogged_jain(records, [bf.BATCH_A, bf.BATCH_B]) == 1.0
    # One admitted request in a 30 s phase against a quota of 2 a minute: exactly the quota.
    assert bf.admitted_rate_ratio(records, bf.NOISY, 2.0, 30.0) == 1.0

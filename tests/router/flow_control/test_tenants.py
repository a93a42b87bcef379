"""The tenant file: what it accepts, what it refuses (with the line), and who a request is."""

from __future__ import annotations

import pytest

from prefixserve.router.flow_control.tenants import TenantFileError, load_tenants, parse_tenants

GOOD = """\
tenant_header: X-SMG-Tenant-Id
tenants:
  - name: team-a
    api_key: key-a
    requests_per_minute: 60
    tokens_per_minute: 100000
    weight: 2
    priorities: [0, 10]
  - name: team-b
    header_value: b
"""


def test_a_good_file_parses_with_defaults() -> None:
    table = parse_tenants(GOOD)
    a, b = table.tenants
    assert (a.name, a.api_key, a.requests_per_minute, a.tokens_per_minute, a.weight, a.priorities) == (
        "team-a", "key-a", 60, 100000, 2.0, (0, 10),
    )  # fmt: skip
    assert (b.header_value, b.requests_per_minute, b.weight, b.priorities) == ("b", None, 1.0, (0, 0))
    assert table.tenant_header == "x-smg-tenant-id"
    assert table.api_keys == ["key-a"]


def test_identify_by_key_then_header() -> None:
    table = parse_tenants(GOOD)
    assert table.identify("key-a", {"x-smg-tenant-id": "b"}).name == "team-a"  # type: ignore[union-attr]
    assert table.identify(None, {"x-smg-tenant-id": "b"}).name == "team-b"  # type: ignore[union-attr]
    assert table.identify("other", {"x-smg-tenant-id": "c"}) is None
    assert table.identify(None, {}) is None


def test_round_trip_through_the_app_args() -> None:
    from prefixserve.router.flow_control.tenants import tenants_from_data

    table = parse_tenants(GOOD)
    again = tenants_from_data(table.to_dict())
    assert again.tenants == table.tenants and again.tenant_header == table.tenant_header


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("tenants: [\n  {name: a, api_key: k\n", 3, "not YAML"),
        ("tenants: []\n", 1, "non-empty list"),
        ("tenant: []\n", 1, "unknown keys ['tenant']"),
        ("tenants:\n  - name: a\n    api_key: k\n    colour: red\n", 4, "unknown tenant keys ['colour']"),
        ("tenants:\n  - name: a\n", 2, "exactly one of api_key and header_value"),
        ("tenants:\n  - name: a\n    api_key: k\n    header_value: v\n", 2, "exactly one"),
        ("tenants:\n  - name: a\n    header_value: v\n", 3, "no tenant_header"),
        ("tenants:\n  - name: ''\n    api_key: k\n", 2, "non-empty string name"),
        ("tenants:\n  - name: a\n    api_key: k\n    requests_per_minute: 0\n", 4, "requests_per_minute must be"),
        ("tenants:\n  - name: a\n    api_key: k\n    weight: -1\n", 4, "weight must be"),
        ("tenants:\n  - name: a\n    api_key: k\n    tokens_per_minute: x\n", 4, "tokens_per_minute must be"),
        ("tenants:\n  - name: a\n    api_key: k\n    priorities: [5, 1]\n", 4, "priorities must be"),
        ("tenants:\n  - name: a\n    api_key: k\n    priorities: [1]\n", 4, "priorities must be"),
        ("tenants:\n  - name: a\n    api_key: k\n  - name: a\n    api_key: j\n", 4, "repeats the name"),
        ("tenants:\n  - name: a\n    api_key: k\n  - name: b\n    api_key: k\n", 4, "repeats the api_key"),
        ("tenants:\n  - just-a-string\n", 2, "must be a mapping"),
    ],
)
def test_a_malformed_file_is_refused_with_its_line(text: str, line: int, words: str) -> None:
    with pytest.raises(TenantFileError) as info:
        parse_tenants(text, "t.yaml")
    assert f"t.yaml line {line}:" in str(info.value)
    assert words in str(info.value)


def test_a_missing_file_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TenantFileError, match="cannot read the tenant file"):
        load_tenants(tmp_path / "absent.yaml")
    path = tmp_path / "t.json"
    path.write_text('{"tenants": [{"name": "a", "api_key": "k"}]}')
    assert load_tenants(path).tenants[0].name == "a"

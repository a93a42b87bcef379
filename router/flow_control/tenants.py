"""Tenants: who sends a request, and what they may use (the ``--tenants FILE`` of the front ends).

Job: parse and validate the tenant file, and tell which tenant a request belongs to from its
API key or a configured header. The file (YAML or JSON)::

    tenant_header: x-smg-tenant-id      # optional: the header whose value names a tenant
    tenants:
      - name: team-a
        api_key: KEY                    # or header_value: VALUE (with tenant_header)
        requests_per_minute: 60         # optional: no request quota when absent
        tokens_per_minute: 100000       # optional: prompt + completion tokens
        weight: 1                       # its share in the fair queue (default 1)
        priorities: [0, 10]             # the priorities it may ask (default [0, 0]); the first
                                        #   is what its requests get when they ask none

Invariants: a file that does not parse, or a tenant that breaks a rule, is refused at start
with the file's line (``TenantFileError``); names, keys and header values are unique; the
lookup is by exact value (API keys compared whole, as the front ends compare them).

Pure: no HTTP, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The top-level keys of the file and of each tenant.
FILE_KEYS = ("tenant_header", "tenants")
TENANT_KEYS = (
    "name",
    "api_key",
    "header_value",
    "requests_per_minute",
    "tokens_per_minute",
    "weight",
    "priorities",
)


class TenantFileError(ValueError):
    """The tenant file is malformed; the message names the file and the line."""


@dataclass(frozen=True)
class TenantSpec:
    """One tenant of the file."""

    name: str
    api_key: str | None = None
    header_value: str | None = None
    # None: no quota of that kind.
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    weight: float = 1.0
    # The inclusive range of priorities (lower runs first) its requests may ask; the first is the default.
    priorities: tuple[int, int] = (0, 0)

    @property
    def default_priority(self) -> int:
        return self.priorities[0]

    def allows(self, priority: int) -> bool:
        return self.priorities[0] <= priority <= self.priorities[1]


class TenantTable:
    """Every tenant, found by API key or by the value of ``tenant_header`` (lower-case; None when
    tenants are told apart by API key only)."""

    def __init__(self, tenants: tuple[TenantSpec, ...], tenant_header: str | None = None) -> None:
        self.tenants = tenants
        self.tenant_header = tenant_header
        self._by_name = {t.name: t for t in tenants}
        self._by_key = {t.api_key: t for t in tenants if t.api_key is not None}
        self._by_header = {t.header_value: t for t in tenants if t.header_value is not None}

    def by_name(self, name: str) -> TenantSpec | None:
        return self._by_name.get(name)

    @property
    def api_keys(self) -> list[str]:
        """The tenants' API keys (each accepted by the front end's key check)."""
        return [t.api_key for t in self.tenants if t.api_key is not None]

    def identify(self, api_key: str | None, headers: Mapping[str, str]) -> TenantSpec | None:
        """The tenant of a request: by its API key, else by ``tenant_header``; None when neither names one."""
        tenant = self._by_key.get(api_key) if api_key is not None else None
        if tenant is None and self.tenant_header is not None:
            value = headers.get(self.tenant_header)
            if value is not None:
                tenant = self._by_header.get(value)
        return tenant

    def to_dict(self) -> dict[str, Any]:
        """The table as a file's mapping (what the app args carry to every ingress replica)."""
        return {
            "tenant_header": self.tenant_header,
            "tenants": [
                {
                    "name": t.name,
                    **({"api_key": t.api_key} if t.api_key is not None else {"header_value": t.header_value}),
                    **({"requests_per_minute": t.requests_per_minute} if t.requests_per_minute is not None else {}),
                    **({"tokens_per_minute": t.tokens_per_minute} if t.tokens_per_minute is not None else {}),
                    "weight": t.weight,
                    "priorities": list(t.priorities),
                }
                for t in self.tenants
            ],
        }


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header as the client sent it (None: no such header)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    try:  # ASGI servers decode header bytes as latin-1: back to the client's bytes, read as UTF-8
        return token.strip().encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return None


def _line(node: yaml.Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def _fail(source: str, node: yaml.Node | None, message: str) -> TenantFileError:
    line = _line(node)
    return TenantFileError(f"{source}{f' line {line}' if line is not None else ''}: {message}")


def _mapping_nodes(node: yaml.Node | None) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """A mapping node's entries by key: (key node, value node); {} for anything else."""
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): (k, v) for k, v in node.value}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _tenant(item: Any, node: yaml.Node | None, source: str, header: str | None) -> TenantSpec:
    entries = _mapping_nodes(node)

    def at(key: str) -> yaml.Node | None:
        return entries[key][1] if key in entries else node

    if not isinstance(item, Mapping):
        raise _fail(source, node, f"a tenant must be a mapping of keys to values, got {type(item).__name__}")
    unknown = sorted(str(k) for k in item if k not in TENANT_KEYS)
    if unknown:
        raise _fail(source, entries[unknown[0]][0] if unknown[0] in entries else node,
                    f"unknown tenant keys {unknown}; known keys: {list(TENANT_KEYS)}")  # fmt: skip
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _fail(source, at("name"), f"a tenant needs a non-empty string name, got {name!r}")
    has_key, has_value = item.get("api_key") is not None, item.get("header_value") is not None
    if has_key == has_value:
        raise _fail(source, node, f"tenant {name!r} needs exactly one of api_key and header_value")
    for key in ("api_key", "header_value"):
        value = item.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _fail(source, at(key), f"tenant {name!r}: {key} must be a non-empty string")
    if has_value and header is None:
        raise _fail(source, at("header_value"), f"tenant {name!r} has a header_value but no tenant_header is set")
    for key in ("requests_per_minute", "tokens_per_minute", "weight"):
        value = item.get(key)
        if value is not None and not _positive(value):
            raise _fail(source, at(key), f"tenant {name!r}: {key} must be a number > 0, got {value!r}")
    priorities = item.get("priorities", [0, 0])
    if (
        not isinstance(priorities, list)
        or len(priorities) != 2
        or any(isinstance(p, bool) or not isinstance(p, int) for p in priorities)
        or priorities[0] > priorities[1]
    ):
        raise _fail(
            source,
            at("priorities"),
            f"tenant {name!r}: priorities must be [lowest, highest] integers, got {priorities!r}",
        )
    return TenantSpec(
        name=name,
        api_key=item.get("api_key"),
        header_value=item.get("header_value"),
        requests_per_minute=item.get("requests_per_minute"),
        tokens_per_minute=item.get("tokens_per_minute"),
        weight=float(item.get("weight", 1.0)),
        priorities=(priorities[0], priorities[1]),
    )


def parse_tenants(text: str, source: str = "tenants") -> TenantTable:
    """The table a tenant file's text describes; TenantFileError (with the line) when it is malformed."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise TenantFileError(f"{source}{where}: not YAML or JSON: {getattr(exc, 'problem', exc)}") from None
    return tenants_from_data(data, source, root)


def tenants_from_data(data: Any, source: str = "tenants", root: yaml.Node | None = None) -> TenantTable:
    """The table of a file's parsed mapping (``root``: its YAML nodes, for the lines of messages)."""
    if not isinstance(data, Mapping):
        raise _fail(source, root, "the tenant file must be a mapping with a 'tenants' list")
    top = _mapping_nodes(root)
    unknown = sorted(str(k) for k in data if k not in FILE_KEYS)
    if unknown:
        raise _fail(source, top[unknown[0]][0] if unknown[0] in top else root,
                    f"unknown keys {unknown}; known keys: {list(FILE_KEYS)}")  # fmt: skip
    header = data.get("tenant_header")
    if header is not None and (not isinstance(header, str) or not header.strip()):
        raise _fail(source, top["tenant_header"][1] if "tenant_header" in top else root,
                    f"tenant_header must be a header name, got {header!r}")  # fmt: skip
    items = data.get("tenants")
    items_node = top["tenants"][1] if "tenants" in top else root
    if not isinstance(items, list) or not items:
        raise _fail(source, items_node, "'tenants' must be a non-empty list")
    nodes = items_node.value if isinstance(items_node, yaml.SequenceNode) else [None] * len(items)
    header = header.strip().lower() if header is not None else None
    tenants: list[TenantSpec] = []
    seen: dict[tuple[str, str], str] = {}
    for item, node in zip(items, nodes, strict=True):
        tenant = _tenant(item, node, source, header)
        for kind, value in (("name", tenant.name), ("api_key", tenant.api_key), ("header_value", tenant.header_value)):
            if value is None:
                continue
            if (kind, value) in seen:
                raise _fail(source, node, f"tenant {tenant.name!r} repeats the {kind} of tenant {seen[kind, value]!r}")
            seen[kind, value] = tenant.name
        tenants.append(tenant)
    return TenantTable(tuple(tenants), header)


def load_tenants(path: str | Path) -> TenantTable:
    """The tenant file at ``path``; TenantFileError naming the file (and line) when it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantFileError(f"{path}: cannot read the tenant file: {exc}") from None
    return parse_tenants(text, str(path))

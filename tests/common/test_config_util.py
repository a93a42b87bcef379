"""common/config_util.py: the one strict from_dict every config section uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from prefixserve.common.config_util import check_switches, from_dict


@dataclass
class Inner:
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


@dataclass
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    tags: dict = field(default_factory=dict)


def test_builds_nested_dataclasses_from_mappings():
    built = from_dict(Outer, {"name": "a", "inner": {"size": 3}, "tags": {"x": 1}}, "outer")
    assert built == Outer("a", Inner(3), {"x": 1})
    assert from_dict(Inner, None, "inner") == Inner()


def test_unknown_keys_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown outer keys \['nmae'\]; known keys: \['inner', 'name', 'tags'\]"):
        from_dict(Outer, {"nmae": "a"}, "outer")
    with pytest.raises(ValueError, match=r"unknown outer.inner keys \['sise'\]; known keys: \['size'\]"):
        from_dict(Outer, {"name": "a", "inner": {"sise": 2}}, "outer")


def test_missing_required_keys_and_non_mappings_are_value_errors():
    with pytest.raises(ValueError, match=r"outer needs keys \['name'\]"):
        from_dict(Outer, {}, "outer")
    with pytest.raises(ValueError, match="outer must be a mapping"):
        from_dict(Outer, ["name"], "outer")


def test_the_dataclass_still_validates_values():
    with pytest.raises(ValueError, match="size must be >= 1"):
        from_dict(Outer, {"name": "a", "inner": {"size": 0}}, "outer")


@dataclass
class Switches:
    on: bool = True
    maybe_on: bool | None = None
    count: int = 0


@pytest.mark.parametrize(
    "data, message",
    [
        ({"on": "false"}, r"switches.on must be true or false, got 'false'"),
        ({"on": 1}, r"switches.on must be true or false, got 1"),
        ({"maybe_on": "auto"}, r"switches.maybe_on must be true or false, got 'auto'"),
    ],
)
def test_a_boolean_field_takes_only_true_or_false(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(Switches, data, "switches")


def test_booleans_none_and_other_types_pass():
    assert from_dict(Switches, {"on": False, "maybe_on": None, "count": 3}, "switches") == Switches(False, None, 3)
    assert from_dict(Switches, {"maybe_on": True}, "switches").maybe_on is True
    check_switches(Switches())
    with pytest.raises(ValueError, match="on must be true or false, got 'no'"):
        check_switches(Switches(on="no"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 8)
    name: str = "x"


def test_an_int_tuple_field_takes_several_values_and_stays_a_tuple():
    import argparse

    from prefixserve.common.config_util import add_cli_arguments, from_cli_args

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, Sizes, "sizes")
    assert from_cli_args(Sizes, parser.parse_args([])) == Sizes()
    parsed = from_cli_args(Sizes, parser.parse_args(["--batches", "2", "4", "16"]))
    assert parsed.batches == (2, 4, 16) and isinstance(parsed.batches, tuple)
    with pytest.raises(SystemExit):
        parser.parse_args(["--batches", "two"])

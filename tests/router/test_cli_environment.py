"""The ``prefixserve`` command gives a subcommand's process its environment defaults before it imports the
subcommand (libgomp reads its spin count when torch loads it), and never overrides the user's."""

from __future__ import annotations

import os

from prefixserve.router import cli


def test_a_replica_starts_with_a_short_openmp_spin_unless_the_user_set_one(monkeypatch, capsys):
    assert cli.ENVIRONMENT_DEFAULTS["replica"] == (("GOMP_SPINCOUNT", "10000", ("OMP_WAIT_POLICY",)),)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli.main(["replica", "--help"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert cli.main(["replica", "--help"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "300000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's policy decides the spin
    assert cli.main(["replica", "--help"]) == 0
    assert "GOMP_SPINCOUNT" not in os.environ


def test_other_subcommands_leave_the_environment_alone(monkeypatch, capsys):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cli.main(["route", "--help"]) == 0
    assert "GOMP_SPINCOUNT" not in os.environ

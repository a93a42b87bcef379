"""The nginx path's placement loop: nginx-config --key-log, prefixserve placement, nginx-config --placement.

Fast tests render configs and replay synthetic key logs through the command;
the real-nginx test sends keyed requests through nginx to backends nginx itself
serves (each answers with its own port), replays the log nginx wrote, reloads
nginx with the rendered placement and checks where the moved keys land.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from nginx_helpers import NGINX, NginxProcess, backends_conf, free_ports, keys_owned, needs_nginx

from prefixserve.router import cli
from prefixserve.router.cli.common import EXIT_SKIPPED
from prefixserve.router.nginx.config import KEY_LOG_FORMAT, RING_KEY_VAR, NginxConfig
from prefixserve.router.nginx.placement import ReplayCounts, parse_key_line, read_key_log
from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, prefix_hash

NAMES = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]
REPLICA_ARGS = [x for n in NAMES for x in ("--replica", n)]


def line(msec: float, key: str, status: str = "200", upstream: str = "127.0.0.1:9101") -> str:
    """One key-log line as nginx writes it with the prefixserve_keys format."""
    return json.dumps({"msec": f"{msec:.3f}", "key": key, "status": status, "upstream": upstream}) + "\n"


def hot_log(hot: str, start: float = 1_700_000_000.0, n: int = 600) -> str:
    """``n`` requests of ``hot`` 50 ms apart, one of a cold key every third."""
    out = []
    t = start
    for i in range(n):
        t += 0.05
        out.append(line(t, hot))
        if i % 3 == 0:
            out.append(line(t, prefix_hash(f"cold-{i % 40}")))
    return "".join(out)


def run_placement(tmp_path: Path, log: str, *extra: str) -> tuple[int, dict | None]:
    path = tmp_path / "keys.log"
    path.write_text(log)
    out = tmp_path / "placement.json"
    out.unlink(missing_ok=True)
    code = cli.main(["placement", str(path), *REPLICA_ARGS, *extra, "-o", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else None


# -- the key log (fast) -------------------------------------------------------------------------


def test_parse_key_line():
    assert parse_key_line(line(12.5, "abc")) == (12.5, "abc")
    assert parse_key_line(line(12.5, "")) == (12.5, None)  # escape=json writes a missing header as ""
    assert parse_key_line(line(12.5, "-")) == (12.5, None)
    assert parse_key_line('{"msec":"1.000","key":"\\u0001x"}') == (1.0, "\x01x")
    for bad in (
        "garbage",
        "[1, 2]",
        '{"key": "a"}',
        '{"msec": "x", "key": "a"}',
        '{"msec": "nan", "key": "a"}',
        '{"msec": "-1", "key": "a"}',
        '{"msec": "1.0"}',
        '{"msec": "1.0", "key": 3}',
        '{"msec": ',
    ):
        with pytest.raises(ValueError):
            parse_key_line(bad)


def test_read_key_log_counts_what_it_skips():
    counts = ReplayCounts()
    lines = [line(1, "a"), "\n", "not json\n", line(2, ""), line(3, "b"), '{"msec":"4"}\n', line(5, "-")]
    assert list(read_key_log(lines, counts)) == [(1.0, "a"), (3.0, "b")]
    assert (counts.lines, counts.unparsed, counts.no_key) == (6, 2, 2)


def test_nginx_config_key_log_renders_the_original_header(tmp_path, capsys):
    assert cli.main(["nginx-config", *REPLICA_ARGS, "--key-log", "/var/log/nginx/keys.log"]) == 0
    text = capsys.readouterr().out
    fmt = next(ln for ln in text.splitlines() if ln.strip().startswith(f"log_format {KEY_LOG_FORMAT} "))
    assert "escape=json" in fmt and '"msec":"$msec"' in fmt and '"key":"$http_x_prefix_hash"' in fmt
    server = text.split("    server {")[1]
    assert f"access_log /var/log/nginx/keys.log {KEY_LOG_FORMAT};" in server
    assert "access_log" not in text.split("    server {")[0].replace(fmt, "")
    # With a placement the upstream hashes the salted key; the log still names the client's key.
    snap = {"format": 1, "version": 1, "members": NAMES, "keys": {}}
    (tmp_path / "p.json").write_text(json.dumps(snap))
    assert cli.main(["nginx-config", *REPLICA_ARGS, "--key-log", "k.log", "--placement", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    assert f"hash {RING_KEY_VAR} consistent;" in text and RING_KEY_VAR not in text.split("log_format")[1].split(";")[0]
    # --access-log is kept: named again in the server block (which replaces the http block's), "off" not repeated.
    assert cli.main(["nginx-config", *REPLICA_ARGS, "--key-log", "k.log", "--access-log", "a.log"]) == 0
    text = capsys.readouterr().out
    assert "    access_log a.log;" in text and "        access_log a.log;" in text.split("    server {")[1]
    assert cli.main(["nginx-config", *REPLICA_ARGS, "--key-log", "k.log", "--access-log", "off"]) == 0
    server = capsys.readouterr().out.split("    server {")[1]
    assert "access_log off" not in server and f"access_log k.log {KEY_LOG_FORMAT};" in server
    # Without --key-log nothing changes (the sample's parity test checks the whole text).
    assert cli.main(["nginx-config", *REPLICA_ARGS]) == 0
    assert "log_format" not in capsys.readouterr().out


@pytest.mark.parametrize("value", ["off", "a b.log", "k.log;"])
def test_nginx_config_rejects_a_bad_key_log(value, capsys):
    assert cli.main(["nginx-config", *REPLICA_ARGS, "--key-log", value]) == 2
    assert "--key-log" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(ValueError):
        NginxConfig(replicas=(RingServer(NAMES[0]),), key_log=value)


# -- prefixserve placement (fast) ---------------------------------------------------------------


def test_a_hot_key_is_replicated_and_rendered_as_split_clients(tmp_path, capsys):
    hot = prefix_hash("hot")
    log = "not a line\n" + hot_log(hot) + line(1_700_000_031.0, "")
    code, snap = run_placement(tmp_path, log)
    assert code == EXIT_SKIPPED and snap is not None  # written, and the bad first line named
    assert set(snap["members"]) == set(NAMES)
    assert len(snap["keys"][hot]["replicas"]) >= 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"prefixserve placement: {tmp_path / 'keys.log'}:1: not a JSON object (skipped)"
    assert len(err) == 2 and "replayed 800 requests" in err[1]
    assert "1 unparsable lines and 1 requests without a key" in err[1]
    conf = tmp_path / "nginx.conf"
    assert (
        cli.main(["nginx-config", *REPLICA_ARGS, "--placement", str(tmp_path / "placement.json"), "-o", str(conf)]) == 0
    )
    text = conf.read_text()
    split = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{hot} $prefixserve_split_"))
    var = split.split()[1].rstrip(";")
    assert f'split_clients "${{request_id}}" {var} {{' in text


def test_the_replay_clock_is_the_logs_time(tmp_path):
    """A key hot long ago (many time constants) is not replicated; the same log squeezed into one moment is."""
    early, late = prefix_hash("early"), prefix_hash("late")
    t0 = 1_700_000_000.0

    def log(gap: float) -> str:
        out = [line(t0 + i * 0.01, early) for i in range(300)]
        out += [line(t0 + gap + i * 0.01, prefix_hash(f"late-cold-{i}")) for i in range(300)]
        out += [line(t0 + gap + 3 + i * 0.01, late) for i in range(30)]
        return "".join(out)

    code, apart = run_placement(tmp_path, log(3600.0), "--tau-s", "60")
    assert code == 0 and apart is not None
    assert early not in apart["keys"]  # forgotten: decayed below the table's threshold an hour later
    code, together = run_placement(tmp_path, log(0.0), "--tau-s", "60")
    assert code == 0 and together is not None
    assert len(together["keys"][early]["replicas"]) >= 2


def test_policy_knobs_reach_the_policy(tmp_path, capsys):
    hot = prefix_hash("hot")
    code, snap = run_placement(tmp_path, hot_log(hot), "--hot-share", "100")
    assert code == 0 and snap is not None and len(snap["keys"][hot]["replicas"]) == 1
    capsys.readouterr()
    for flag, value, message in (
        ("--epsilon", "-1", "epsilon must be a finite number > 0"),
        ("--noise-z", "-2", "noise_z must be a finite number >= 0"),
        ("--tau-s", "inf", "tau_s must be a finite number > 0"),
    ):
        code, snap = run_placement(tmp_path, hot_log(hot, n=3), flag, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and snap is None and err == [f"prefixserve placement: error: {err[0].split(': ', 2)[2]}"]
        assert message in err[0]


def test_weights_and_stdin(tmp_path, monkeypatch, capsys):
    hot = prefix_hash("hot")
    monkeypatch.setattr("sys.stdin", io.StringIO(hot_log(hot, n=30)))
    assert cli.main(["placement", "-", "--replica", NAMES[0], "--replica", f"{NAMES[1]}=3"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["weights"] == {NAMES[0]: 1, NAMES[1]: 3} and set(snap["members"]) == set(NAMES[:2])


def test_previous_carries_the_last_rounds_placement(tmp_path, capsys):
    """A round seeded with the last one's snapshot keeps its placements; one from scratch rebuilds them."""
    ring = HashRing(NAMES)
    crowded = keys_owned(ring, NAMES[0], 24, seed="crowded")  # one replica's keys only: it sheds some
    t0 = 1_700_000_000.0
    first = "".join(line(t0 + i * 0.01, crowded[i % len(crowded)]) for i in range(24 * 8))
    code, snap1 = run_placement(tmp_path, first)
    assert code == 0 and snap1 is not None
    placed1 = {k: e["replicas"] for k, e in snap1["keys"].items()}
    assert any(r[0] != NAMES[0] for r in placed1.values())
    (tmp_path / "round1.json").write_text(json.dumps(snap1))
    # The next round's log (after rotation): each key once more in another order, too little to move anything.
    second = "".join(line(t0 + 10 + i * 0.01, k) for i, k in enumerate(reversed(crowded)))
    code, snap2 = run_placement(tmp_path, second, "--previous", str(tmp_path / "round1.json"))
    assert code == 0 and snap2 is not None
    assert {k: e["replicas"] for k, e in snap2["keys"].items()} == placed1
    assert snap2["keys"][crowded[0]]["rate"] > 8  # the statistics carried over too
    code, scratch = run_placement(tmp_path, second)
    assert code == 0 and scratch is not None
    assert {k: e["replicas"] for k, e in scratch["keys"].items()} != placed1
    (tmp_path / "bad.json").write_text('{"format": 1, "members": ["a:1"], "keys": {"k": {}}}')
    capsys.readouterr()
    code, _ = run_placement(tmp_path, second, "--previous", str(tmp_path / "bad.json"))
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prefixserve placement: error: --previous is not a placement snapshot: no 'rate'"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["MISSING", "--replica", NAMES[0]], "cannot read MISSING"),
        (["DIR", "--replica", NAMES[0]], "cannot read DIR"),
        (["EMPTY", "--replica", NAMES[0]], "no request with a key in EMPTY (0 lines"),
        (["JUNK", "--replica", NAMES[0]], "no request with a key in JUNK (2 lines: 1 unparsable, 1 without a key)"),
        (["EMPTY", "--replica", "10.0.0.1:80=x"], "the weight after '=' must be an integer"),
        (["EMPTY", "--replica", "bad host:80"], "not a valid host name"),
        (["EMPTY", "--replica", "a:1", "--replica", "a:1=2"], "replica names must be unique"),
        (["EMPTY"], "required: --replica"),
        (["JUNK", "--replica", NAMES[0], "--previous", "MISSING"], "cannot read the placement from MISSING"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "JUNK").write_text("junk\n" + line(1, "-"))
    (tmp_path / "DIR").mkdir()
    paths = {name: str(tmp_path / name) for name in ("MISSING", "DIR", "EMPTY", "JUNK")}
    argv = [paths.get(a, a) for a in argv]
    assert cli.main(["placement", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("prefixserve placement: error:")
    for name, path in paths.items():
        message = message.replace(name, path)
    assert message in last
    assert "Traceback" not in captured.err


def test_hostile_lines_are_named_one_each_and_the_replay_goes_on(tmp_path, capsys):
    hot = prefix_hash("hot")
    bad = [
        "[" * 100_000 + "\n",  # nested past the decoder's recursion limit
        '{"msec": "1700000000.5", "key": "\\ud800"}\n',  # a lone surrogate: no hash can encode it
        '{"msec": 1' + "0" * 400 + ', "key": "k"}\n',
    ]  # a time too large for a float
    code, snap = run_placement(tmp_path, "".join(bad) + hot_log(hot, n=30))
    assert code == EXIT_SKIPPED and snap is not None and hot in snap["keys"]
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    path = tmp_path / "keys.log"
    assert err[:3] == [
        f"prefixserve placement: {path}:1: not a JSON object (nested too deeply) (skipped)",
        f"prefixserve placement: {path}:2: the key holds a lone surrogate at character 0: not Unicode text (skipped)",
        f"prefixserve placement: {path}:3: no msec time (skipped)",
    ]
    assert len(err) == 4 and "skipped 3 unparsable lines" in err[3] and "Traceback" not in captured.err
    assert run_placement(tmp_path, hot_log(hot, n=30))[0] == 0  # nothing skipped: status 0


def _placement_file(tmp_path: Path, snapshot) -> str:
    path = tmp_path / "p.json"
    path.write_text(snapshot if isinstance(snapshot, str) else json.dumps(snapshot))
    return str(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": 2}, "the placement's format 2 is not one this version reads (expected 1)"),
        ({"format": None}, "the placement's format None is not one this version reads"),
        ({"version": "7"}, "the placement's version must be a whole number >= 0, got '7'"),
        ({"members": "127.0.0.1:9101"}, "the placement's members must be a list of replica names"),
        ({"keys": {"abc": {"replicas": NAMES[1]}}}, "key 'abc': 'replicas' must be a list of replica names, got str"),
        ({"keys": {"abc": {"replicas": [9101]}}}, "key 'abc': 'replicas' must be a list of replica names"),
        ({"keys": {"abc": {}}}, "key 'abc': 'replicas' must be a list of replica names, got NoneType"),
        ({"keys": {"abc": [NAMES[1]]}}, "key 'abc': 'replicas' must be a list of replica names, got list"),
        ({"keys": {"abc": {"replicas": [NAMES[1], NAMES[1]]}}}, "key 'abc': 'replicas' names a replica twice"),
        ({"keys": {"abc": {"replicas": ["10.9.9.9:1"]}}}, "key 'abc': replicas ['10.9.9.9:1'] are not among"),
        ("[" * 100_000, "JSON nested too deeply"),
    ],
)
def test_nginx_config_refuses_a_malformed_placement(change, message, tmp_path, capsys):
    snap = change if isinstance(change, str) else {"format": 1, "version": 1, "members": NAMES, "keys": {}, **change}
    argv = ["nginx-config", *REPLICA_ARGS, "--placement", _placement_file(tmp_path, snap)]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prefixserve nginx-config: error: ") and message in err[0]


# -- a real nginx -------------------------------------------------------------------------------


def _render(tmp_path: Path, front: int, backends: list[int], *extra: str) -> Path:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "backends.conf").write_text(backends_conf(backends))
    conf = tmp_path / "nginx.conf"
    argv = [
        "nginx-config",
        *(x for p in backends for x in ("--replica", f"127.0.0.1:{p}")),
        "--listen",
        f"127.0.0.1:{front}",
        "--worker-processes",
        "1",
        "--temp-dir",
        str(tmp_path / "tmp"),
        "--pid-file",
        str(tmp_path / "nginx.pid"),
        "--error-log",
        str(tmp_path / "logs" / "error.log"),
        "--access-log",
        "off",
        "--include",
        str(tmp_path / "backends.conf"),
        "--key-log",
        str(tmp_path / "logs" / "keys.log"),
        *extra,
        "-o",
        str(conf),
    ]
    assert cli.main(argv) == 0
    return conf


def _log_lines(path: Path, n: int) -> list[str]:
    """The key log once it has ``n`` lines (nginx writes a line after the response has gone out)."""
    deadline = time.monotonic() + 10
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


@needs_nginx
def test_real_nginx_key_log_to_placement_to_reload(tmp_path, capsys):
    front, *backends = free_ports(4)
    names = [f"127.0.0.1:{p}" for p in backends]
    ring = HashRing(names)
    crowded = keys_owned(ring, names[0], 24, seed="crowded")  # every one owned by the first replica
    hot = keys_owned(ring, names[1], 1, seed="hot")[0]
    conf = _render(tmp_path, front, backends)
    key_log = tmp_path / "logs" / "keys.log"
    with NginxProcess(NGINX, conf, tmp_path, wait_ports=[front, *backends]) as nginx:

        def landed(http: httpx.Client, key: str | None) -> str:
            r = http.get("/v1/models", headers={PREFIX_HASH_HEADER: key} if key else {})
            assert r.status_code == 200, r.text
            return f"127.0.0.1:{r.text}"

        with httpx.Client(base_url=f"http://127.0.0.1:{front}", timeout=10) as http:
            for _ in range(4):  # without a placement: the ring owner
                for k in crowded:
                    assert landed(http, k) == names[0]
                for _ in range(40):
                    assert landed(http, hot) == names[1]
                landed(http, None)
            sent = 4 * (len(crowded) + 40 + 1)
        lines = _log_lines(key_log, sent)
        assert len(lines) == sent
        assert {json.loads(x)["key"] for x in lines} == {*crowded, hot, ""}

        placement = tmp_path / "placement.json"
        assert (
            cli.main(["placement", str(key_log), *(x for n in names for x in ("--replica", n)), "-o", str(placement)])
            == 0
        )
        assert f"replayed {sent - 4} requests" in capsys.readouterr().err
        snap = json.loads(placement.read_text())
        moved = {
            k: e["replicas"][0]
            for k, e in snap["keys"].items()
            if len(e["replicas"]) == 1 and e["replicas"][0] != ring.owner(k)
        }
        assert moved and set(moved) <= set(crowded)  # the crowded replica shed some of its keys
        copies = snap["keys"][hot]["replicas"]
        assert len(copies) >= 2  # the hot key is replicated

        _render(tmp_path, front, backends, "--placement", str(placement))
        nginx.reload()
        with httpx.Client(base_url=f"http://127.0.0.1:{front}", timeout=10) as http:
            for k in crowded:
                assert landed(http, k) == moved.get(k, names[0])
            spread = Counter(landed(http, hot) for _ in range(90))
        assert set(spread) == set(copies), (spread, copies)
        # The log still names the client's key, not the salted one the upstream hashed.
        after = _log_lines(key_log, sent + len(crowded) + 90)[sent:]
        assert len(after) == len(crowded) + 90
        assert {json.loads(x)["key"] for x in after} == {*crowded, hot}

"""The wheel built from the checkout: its layout is the namespace setup.py maps, and installed on its own it serves.

The wheel is installed with ``pip --target`` into a folder of its own and run with ``python -I -S``, so neither the
checkout, nor the editable install's link tree (a ``.pth`` that only ``site`` reads) can stand in for it: the
dependencies come from the virtual environment's site-packages, prefixserve from the wheel alone.
"""

from __future__ import annotations

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
from process_helpers import ManagedProcess
from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
DESIGN_FOLDERS = ("common", "kernels", "replica", "router", "loadtest")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("prefixserve-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


def _isolated(installed: Path, code: str) -> list[str]:
    """``python -I -S`` with only the wheel's folder and the venv's site-packages on sys.path."""
    paths = [str(installed), *site.getsitepackages()]
    return [sys.executable, "-I", "-S", "-c", f"import sys; sys.path[:0] = {paths!r}\n{code}"]


def test_the_wheel_holds_one_package_laid_out_as_the_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"prefixserve"}, tops
    for folder in DESIGN_FOLDERS:
        assert any(name.startswith(f"prefixserve/{folder}/") for name in names), folder
    assert "prefixserve/kernels/backends.py" in names
    assert "prefixserve/kernels/__init__.py" not in names
    assert any(name.startswith("prefixserve/kernels/cpu/") and name.endswith(".c") for name in names)
    assert any(name.endswith(".jinja") for name in names)
    assert not any("__pycache__" in name for name in names)


def test_installed_alone_it_imports_from_its_own_folder(installed: Path) -> None:
    code = (
        "import prefixserve, prefixserve.kernels.backends as b, prefixserve.router.cli as c\n"
        "print(prefixserve.__file__); print(b.__file__); print(c.__file__)"
    )
    out = subprocess.run(_isolated(installed, code), capture_output=True, text=True, check=True, cwd=installed)
    for line in out.stdout.split():
        assert Path(line).resolve().is_relative_to(installed.resolve()), line


def test_installed_alone_it_serves(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    code = (
        "from prefixserve.router.cli import main\n"
        f"sys.exit(main(['replica', '--model', 'smollm2', '--host', '127.0.0.1', "
        f"'--port', '{port}', '--log-level', 'warning']))"
    )
    server = ManagedProcess(
        _isolated(installed, code),
        log_path=tmp_path / "replica.log",
        ready_url=f"http://127.0.0.1:{port}/health",
        startup_timeout_s=300,
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"},
        poll_s=0.5,
    )
    with server:
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1

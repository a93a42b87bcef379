"""The import rule of docs/design.md, read from the source: layers point one way, router/ sees replica/ only
through its contracts, and replica/ and kernels/ have no import loops.

Every ``import`` and ``from ... import`` of every module is parsed (ast), including imports inside functions;
only imports under ``if TYPE_CHECKING:`` are left out of the loop check and of what a module loads (they never
run). What a module loads is the closure of its imports, each module's packages included: router/ modules
other than the Serve adapters hosting the HTTP front end never load the front end, and the contract loads
neither the engine nor the front end.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower layers first: a module may import its own layer and the layers before it.
LAYERS = ("common", "kernels", "replica", "router", "loadtest")

# What router/ may import of replica/ (each a module, or a package with its modules): the ingress<->engine
# contract, the request errors with their HTTP status, the block hashing (Contract 2), the
# engine config the cluster builds, and the replica's entry points the router hosts (the OpenAI front end
# its ingress serves, the Serve deployment its app binds).
ROUTER_MAY_IMPORT = frozenset(
    {
        "prefixserve.replica.contract",
        "prefixserve.replica.errors",
        "prefixserve.replica.kv.hashing",
        "prefixserve.replica.config",
        "prefixserve.replica.entrypoints.openai.protocol",
        "prefixserve.replica.entrypoints.openai.http_frontend",
        "prefixserve.replica.entrypoints.openai.response_store",
        "prefixserve.replica.entrypoints.openai.responses_endpoint",
        "prefixserve.replica.entrypoints.serve.deployment",
    }
)

# Folders whose modules must not import one another in a loop.
ACYCLIC = ("replica", "kernels")

# The router's modules that host the replica's HTTP front end (the Serve ingress, the app that binds it, the
# CLI that starts it): the only router/ modules that may load replica/entrypoints/ at all.
ROUTER_FRONTEND_HOSTS = ("prefixserve.router.serve.ingress", "prefixserve.router.serve.app", "prefixserve.router.cli")

# What must never be loaded, even through other modules, by the modules under a prefix: (loader, loaded).
NEVER_LOADS = (
    ("prefixserve.router", "prefixserve.replica.entrypoints"),
    ("prefixserve.replica.contract", "prefixserve.replica.engine"),
    ("prefixserve.replica.contract", "prefixserve.replica.entrypoints"),
)


@dataclass(frozen=True)
class Import:
    """One import edge: ``module`` imports ``target`` (both dotted, under prefixserve.) at ``line``."""

    module: str
    target: str
    line: int
    type_checking: bool


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the five folders, by its dotted name."""
    out: dict[str, Path] = {}
    for top in LAYERS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["prefixserve", *parts])] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The prefixserve modules ``module`` imports: the longest known module each import names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: list[Import] = []

    def add(name: str, line: int) -> None:
        parts = name.split(".")
        for i in range(len(parts), 1, -1):
            cand = ".".join(parts[:i])
            if cand in modules:
                if cand != module:
                    out.append(Import(module, cand, line, line in guarded))
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                # ``from prefixserve.replica import config`` imports the submodule.
                add(f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else name, node.lineno)
    return out


def all_imports(root: Path = ROOT) -> list[Import]:
    modules = module_files(root)
    return [imp for mod, path in modules.items() for imp in imports_of(mod, path, modules)]


def layer(module: str) -> str:
    return module.split(".")[1]


def router_may_import(target: str) -> bool:
    return any(target == allowed or target.startswith(allowed + ".") for allowed in ROUTER_MAY_IMPORT)


def violations(imports: list[Import]) -> list[str]:
    """Each import across layers the rule forbids, as ``module:line -> target (why)``."""
    bad: list[str] = []
    for imp in dict.fromkeys(imports):
        src, dst = layer(imp.module), layer(imp.target)
        if src == dst:
            continue
        where = f"{imp.module}:{imp.line} -> {imp.target}"
        if LAYERS.index(dst) > LAYERS.index(src):
            bad.append(f"{where} (imports a higher layer: {src} -> {dst})")
        elif src == "router" and dst == "replica" and not router_may_import(imp.target):
            bad.append(f"{where} (router/ imports of replica/ are only ROUTER_MAY_IMPORT)")
        elif src == "router" and dst == "kernels":
            bad.append(f"{where} (router/ reaches kernels/ only through replica/)")
    return bad


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def load_paths(start: str, imports: list[Import], modules: Iterable[str]) -> dict[str, list[str]]:
    """Every module importing ``start`` runs (imports under TYPE_CHECKING left out), each with one chain of
    imports that loads it: ``{module: [start, ..., module]}``. Importing a module first runs its packages'
    ``__init__``, so they count as imported by it."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_checking:
            graph.setdefault(imp.module, set()).add(imp.target)
    paths = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        packages = {".".join(parts[:i]) for i in range(2, len(parts))} & known
        for nxt in sorted(graph.get(module, set()) | packages):
            if nxt not in paths:
                paths[nxt] = [*paths[module], nxt]
                todo.append(nxt)
    del paths[start]
    return paths


def load_violations(imports: list[Import], modules: Iterable[str]) -> list[str]:
    """Each module that loads what NEVER_LOADS forbids it, as ``module loads target (a -> b -> target)``."""
    modules = list(modules)
    bad: list[str] = []
    for module in sorted(modules):
        rules = [loaded for loader, loaded in NEVER_LOADS if under(module, loader)]
        if not rules or any(under(module, host) for host in ROUTER_FRONTEND_HOSTS):
            continue
        for target, path in sorted(load_paths(module, imports, modules).items()):
            if any(under(target, loaded) for loaded in rules):
                bad.append(f"{module} loads {target} ({' -> '.join(path)})")
    return bad


def cycles(imports: list[Import], folder: str) -> list[list[str]]:
    """The import loops among ``folder``'s modules (one per strongly connected component of two or more)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.type_checking or layer(imp.module) != folder or layer(imp.target) != folder:
            continue
        graph.setdefault(imp.module, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    # Tarjan's strongly connected components, iterative.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return found


def test_every_folder_is_parsed() -> None:
    modules = module_files()
    for top in LAYERS:
        assert any(m == f"prefixserve.{top}" or m.startswith(f"prefixserve.{top}.") for m in modules), top
    assert "prefixserve.replica.contract" in modules and "prefixserve.replica.kv.hashing" in modules


def test_imports_point_one_way() -> None:
    bad = violations(all_imports())
    assert not bad, "imports against docs/design.md's rule:\n" + "\n".join(bad)


def test_what_modules_load_stays_below_them() -> None:
    bad = load_violations(all_imports(), module_files())
    assert not bad, "modules loading what docs/design.md's rule keeps from them:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ACYCLIC)
def test_no_import_loops(folder: str) -> None:
    loops = cycles(all_imports(), folder)
    assert not loops, f"import loops in {folder}/:\n" + "\n".join(" <-> ".join(c) for c in loops)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _empty(root: Path, *rels: str) -> None:
    """Empty modules (packages' ``__init__`` files, modules a test only imports)."""
    for rel in rels:
        _write(root, rel, "")


def _mini_tree(root: Path) -> None:
    for top in LAYERS:
        _write(root, f"{top}/__init__.py", "")
    _empty(root, "replica/contract.py", "replica/config.py", "replica/kv/__init__.py", "replica/kv/hashing.py")
    _write(root, "replica/step.py", "import prefixserve.kernels\nfrom prefixserve.common import x\n")
    _write(
        root, "router/prefix.py", "from prefixserve.replica.contract import A\nfrom prefixserve.replica import config\n"
    )


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    _mini_tree(tmp_path)
    assert violations(all_imports(tmp_path)) == []
    _write(tmp_path, "router/policies.py", "def f():\n    from prefixserve.replica.step import Engine\n")
    _write(tmp_path, "kernels/ops.py", "from prefixserve.replica import step\n")
    _write(tmp_path, "common/util.py", "import prefixserve.router.prefix\n")
    bad = violations(all_imports(tmp_path))
    assert any(b.startswith("prefixserve.router.policies:2 -> prefixserve.replica.step (router/") for b in bad), bad
    assert any(b.startswith("prefixserve.kernels.ops:1 -> prefixserve.replica.step (imports a higher") for b in bad)
    assert any(b.startswith("prefixserve.common.util:1 -> prefixserve.router.prefix (imports a higher") for b in bad)
    assert len(bad) == 3, bad


def test_the_load_check_follows_imports_through_other_modules(tmp_path: Path) -> None:
    _mini_tree(tmp_path)
    _empty(
        tmp_path,
        "replica/entrypoints/__init__.py",
        "replica/entrypoints/front.py",
        "replica/engine/__init__.py",
        "replica/engine/step.py",
        "replica/util.py",
        "router/serve/__init__.py",
    )
    _write(tmp_path, "router/serve/ingress.py", "from prefixserve.replica import config\n")
    # What never runs does not count: a TYPE_CHECKING import of the engine from the contract.
    _write(
        tmp_path,
        "replica/contract.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefixserve.replica.engine import step\n",
    )
    assert load_violations(all_imports(tmp_path), module_files(tmp_path)) == []
    # Each import allowed on its own (router -> config, contract -> util), forbidden through the next one.
    _write(tmp_path, "replica/config.py", "def f():\n    from prefixserve.replica.entrypoints import front\n")
    _write(tmp_path, "replica/contract.py", "from prefixserve.replica import util\n")
    _write(tmp_path, "replica/util.py", "import prefixserve.replica.engine.step\n")
    imports = all_imports(tmp_path)
    assert violations(imports) == []
    bad = load_violations(imports, module_files(tmp_path))
    assert bad == [
        "prefixserve.replica.contract loads prefixserve.replica.engine (prefixserve.replica.contract -> "
        "prefixserve.replica.util -> prefixserve.replica.engine.step -> prefixserve.replica.engine)",
        "prefixserve.replica.contract loads prefixserve.replica.engine.step (prefixserve.replica.contract -> "
        "prefixserve.replica.util -> prefixserve.replica.engine.step)",
        "prefixserve.router.prefix loads prefixserve.replica.entrypoints (prefixserve.router.prefix -> "
        "prefixserve.replica.config -> prefixserve.replica.entrypoints.front -> prefixserve.replica.entrypoints)",
        "prefixserve.router.prefix loads prefixserve.replica.entrypoints.front (prefixserve.router.prefix -> "
        "prefixserve.replica.config -> prefixserve.replica.entrypoints.front)",
    ], bad


def test_loops_are_found_and_type_checking_imports_are_not_loops(tmp_path: Path) -> None:
    _mini_tree(tmp_path)
    _write(tmp_path, "replica/a.py", "from prefixserve.replica.b import B\n")
    _write(
        tmp_path,
        "replica/b.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefixserve.replica.a import A\n",
    )
    assert cycles(all_imports(tmp_path), "replica") == []
    _write(tmp_path, "replica/b.py", "def f():\n    from prefixserve.replica import a\n")
    assert cycles(all_imports(tmp_path), "replica") == [["prefixserve.replica.a", "prefixserve.replica.b"]]


_WHERE_KERNELS_IMPORTS_FROM = """
import importlib.util
spec = importlib.util.find_spec("kernels")
print(spec.origin if spec is not None and spec.origin else None)
"""


def test_run_from_the_checkout_the_top_level_kernels_folder_shadows_no_distribution() -> None:
    # `python -c` from the root puts the root first on sys.path, as `python -m` and Ray's workers do; nothing
    # of ours is imported first, so no import-time fix can hide a shadowing folder.
    out = subprocess.run(
        [sys.executable, "-c", _WHERE_KERNELS_IMPORTS_FROM], cwd=ROOT, capture_output=True, text=True, check=True
    )
    origin = out.stdout.strip()
    assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin


def test_run_from_the_checkout_transformers_imports_before_prefixserve() -> None:
    # transformers imports Hugging Face's `kernels` package; the root's kernels/ must not answer for it.
    out = subprocess.run(
        [sys.executable, "-c", "import transformers.modeling_utils"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_namespace_comes_from_the_build_configuration_not_from_links() -> None:
    links = [str(p.relative_to(ROOT)) for top in ("src", *LAYERS) for p in (ROOT / top).rglob("*") if p.is_symlink()]
    assert not links, links
    assert sorted(p.name for p in (ROOT / "src" / "prefixserve").iterdir() if p.name != "__pycache__") == [
        "__init__.py"
    ]
    assert not (ROOT / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace portion"
    code = (
        "import prefixserve.kernels.backends as b, prefixserve.replica.config as c, os\n"
        "print(os.path.realpath(b.__file__)); print(os.path.realpath(c.__file__))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(ROOT / "kernels" / "backends.py"), str(ROOT / "replica" / "config.py")]

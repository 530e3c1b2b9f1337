"""The house rules docs/design.md states, read from the source: arrows between packages go down, no
module-level import circle, the allocator imports no tensor framework, no package file over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hybridkv"
LEAVES = {"errors", "units"}
# docs/design.md's "who may import whom": each package and the packages it may import
ALLOWED: dict[str, set[str]] = {
    "models": LEAVES,
    "planner": {"models"} | LEAVES,
    "blockmgr": {"planner", "models"} | LEAVES,
    "ops": {"planner", "models"} | LEAVES,
    "transfer": {"blockmgr", "ops", "planner", "models"} | LEAVES,
    "scheduler_adapter": {"transfer", "blockmgr", "planner", "models"} | LEAVES,
    "integrations": {"scheduler_adapter", "transfer", "ops", "blockmgr", "planner", "models"} | LEAVES,
    "sim": {"scheduler_adapter", "transfer", "blockmgr", "planner", "models"} | LEAVES,
    "cli": {"sim", "scheduler_adapter", "planner", "models", "<root>"} | LEAVES,
}
# old paths that re-export a module that moved up (docs/design.md: "Old paths ... still re-export")
SHIMS = {
    "hybridkv.scheduler_adapter.cost": "hybridkv.sim",
    "hybridkv.scheduler_adapter.fastdeploy": "hybridkv.integrations",
    "hybridkv.scheduler_adapter.fastdeploy_gdn": "hybridkv.integrations",
    "hybridkv.scheduler_adapter.fastdeploy_state": "hybridkv.integrations",
    "hybridkv.scheduler_adapter.fastdeploy_worker": "hybridkv.integrations",
    "hybridkv.scheduler_adapter": "hybridkv.integrations",  # __getattr__, on first use
}
TENSOR_FRAMEWORKS = {"torch", "paddle", "triton", "jax", "cupy"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(mod: str, path: Path, top_level_only: bool) -> set[str]:
    """Absolute names ``mod`` imports (``top_level_only``: at import time, outside functions and
    ``if TYPE_CHECKING:`` blocks)."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                found.add(name)
                found.update(f"{name}.{a.name}" for a in child.names)  # (a submodule imported by name)
            visit(child)

    visit(tree)
    return found


def _package(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_arrows_between_packages_go_down():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        own = _package(mod)
        if own not in ALLOWED:
            continue
        for name in _imports(mod, path, top_level_only=False):
            if not name.startswith("hybridkv.") or name not in mods:
                continue
            other = _package(name)
            if other == own or other in ALLOWED[own]:
                continue
            if mod in SHIMS and name.startswith(SHIMS[mod]):
                continue
            bad.append(f"{mod} imports {name} ({own} -> {other})")
    assert not bad, "\n".join(bad)


def test_no_module_level_import_circle():
    mods = _modules()
    # (a module's own packages are being imported when it runs: an import of one is no edge)
    graph = {m: {n for n in _imports(m, p, top_level_only=True) if n in mods and not (m + ".").startswith(n + ".")}
             for m, p in mods.items()}  # fmt: skip
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_allocator_imports_no_tensor_framework():
    bad = [f"{m}: {n}" for m, p in _modules().items() if _package(m) in {"blockmgr", "planner", "models"}
           for n in _imports(m, p, top_level_only=False) if n.split(".")[0] in TENSOR_FRAMEWORKS]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_no_package_file_is_over_600_lines():
    lines = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    long = {k: n for k, n in lines.items() if n > 600}
    assert not long, long

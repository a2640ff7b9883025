"""The two dependency lists agree, and committed notebooks are clean."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]

# conda names that differ from PyPI names
CONDA_TO_PYPI = {"pytorch": "torch"}


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_names() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = list(data["project"]["dependencies"]) + list(data["project"]["optional-dependencies"]["dev"])
    return {_name(r) for r in reqs}


def conda_names(text: str) -> set[str]:
    env = yaml.safe_load(text)
    names = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):  # a pip: section
            names |= {_name(r) for r in dep.get("pip", [])}
            continue
        n = _name(dep)
        if n != "python":
            names.add(CONDA_TO_PYPI.get(n, n))
    return names


def test_environment_yml_matches_pyproject():
    conda = conda_names((ROOT / "environment.yml").read_text())
    pip = pyproject_names()
    assert conda == pip, f"only in environment.yml: {sorted(conda - pip)}; only in pyproject: {sorted(pip - conda)}"


def test_comparison_catches_a_missing_dependency():
    text = (ROOT / "environment.yml").read_text().replace("  - cloudpickle\n", "")
    assert "cloudpickle" not in conda_names(text)
    assert conda_names(text) != pyproject_names()


def _tracked_notebooks() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.ipynb"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout
    files = [ROOT / p for p in out.split()]
    return files or sorted((ROOT / "notebooks").glob("*.ipynb"))


def notebook_problems(nb: dict) -> list[str]:
    """What keeps a notebook from being committable: outputs, execution counts, a foreign kernel."""
    problems = []
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    if kernel != "python3":
        problems.append(f"kernelspec is {kernel!r}, not 'python3'")
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i} has an execution count")
    return problems


def test_committed_notebooks_are_stripped_and_use_python3():
    notebooks = _tracked_notebooks()
    assert notebooks, "no notebooks found"
    bad = {str(p.relative_to(ROOT)): notebook_problems(json.loads(p.read_text())) for p in notebooks}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"strip outputs (nbstripout) and use the python3 kernel: {bad}"


def test_hygiene_check_catches_outputs_and_kernels():
    cell = {"cell_type": "code", "source": "1", "outputs": [{"output_type": "stream"}], "execution_count": 1}
    nb = {"metadata": {"kernelspec": {"name": "myenv"}}, "cells": [cell]}
    problems = notebook_problems(nb)
    assert any("outputs" in p for p in problems)
    assert any("execution count" in p for p in problems)
    assert any("kernelspec" in p for p in problems)


def test_setup_says_what_to_install_when_venv_is_missing(tmp_path):
    """A Python without a working venv module (Debian/Ubuntu without python3-venv): a clear error, and no
    half-made environment that the next run would take as ready."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")  # fails `-c 'import torch'` and `-m venv` alike
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    res = subprocess.run(["bash", str(ROOT / "launch" / "setup_env.sh")], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "VENV": str(venv)}, timeout=60)
    assert res.returncode == 1 and "python3-venv" in res.stderr, res.stdout + res.stderr
    assert not venv.exists()


def test_the_lab_installs_no_browser():
    """`make lab` installs what the lab needs: chromium (for the browser test) is make test's business only."""
    assert "chromium" not in (ROOT / "launch" / "setup_env.sh").read_text()
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "tests/install_browser.sh" in test_recipe
    lab_recipe = makefile.split("\nlab: ", 1)[1].split("\n\n", 1)[0]
    assert "install_browser" not in lab_recipe


# ---- the house's rules (docs/lessons.md): functions that fit on a screen, no import circles

MAX_FUNCTION_LINES = 80


def long_functions(folder: Path) -> list[str]:
    """'path:line name (N lines)' for each function under `folder` longer than MAX_FUNCTION_LINES."""
    import ast

    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Which of the package's modules each module imports (at any level: a function's lazy import counts too)."""
    import ast

    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import one another, directly or round a circle (strongly connected, size > 1)."""
    circles, seen = [], set()
    reach = {m: _reachable(graph, m) for m in graph}
    for m in sorted(graph):
        group = sorted(n for n in reach[m] if m in reach[n]) if m in reach[m] else []
        if group and m not in seen:
            seen.update(group)
            circles.append(group)
    return circles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    found, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m not in found:
            found.add(m)
            todo.extend(graph[m])
    return found


def test_no_function_is_longer_than_a_screen_outside_the_tests():
    long = [f for folder in ("course_utils", "launch", "benchmarks") for f in long_functions(ROOT / folder)]
    assert not long, f"split these into functions of at most {MAX_FUNCTION_LINES} lines: {long}"


def test_the_package_has_no_import_circle():
    assert not import_circles(import_graph(ROOT / "course_utils"))


def test_the_house_rules_catch_what_they_are_for(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g  # a lazy import closes the circle\n")
    (pkg / "c.py").write_text("def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert import_circles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
    assert long_functions(pkg) == [f"pkg/c.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]

"""Run one exercise of a lesson notebook in a fresh kernel: its setup cells, its solution (or a wrong
answer in place of the solution block) and its check cell. Shared by the lesson tests.

`grade_answers` grades answers the way the grader does (probe in a throwaway process, verdict from plain data
in this process), for lesson tests that want the grader's verdict rather than the notebook's."""

from __future__ import annotations

import ast
import contextlib
import io
import json
from pathlib import Path

import nbformat

from course_utils.grading import release
from tests.conftest import retrying_kernel_start

ROOT = Path(__file__).resolve().parents[1]


def exercise_cells(nb: dict, ex: str, replacement: str | None) -> list[str]:
    """The setup cells, then the exercise's solution cell(s) (optionally with a wrong answer, substituted as the
    grader substitutes answers) and check cell."""
    if replacement is not None:
        nb = release.substitute(nbformat.reads(json.dumps(nb), as_version=4), {ex: replacement}, ex)
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    src = ["".join(c["source"]) for c in cells]
    setup = [s for c, s in zip(cells, src, strict=True) if "setup" in c["metadata"].get("tags", [])]
    grade = [c["metadata"].get("nbgrader", {}).get("grade_id") for c in cells]
    check = grade.index(ex)
    sol = [i for i, g in enumerate(grade) if g == f"{ex}_solution"]
    assert sol and all(i < check for i in sol), "solution cell(s) must come before the check cell"
    return setup + [src[i] for i in sol] + [src[check]]


def run_cells(sources: list[str]) -> tuple[str, str | None]:
    """Execute cells in a fresh kernel; return the text output of the last cell and its error name (or None)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    error = None
    try:
        retrying_kernel_start(lambda: NotebookClient(nb, timeout=300, kernel_name="python3",
                                                     resources={"metadata": {"path": str(ROOT)}}).execute(),
                              "run_cells")()
    except CellExecutionError as exc:
        error = exc.ename
    outs = nb.cells[-1].get("outputs", [])
    text = "".join(o.get("text", "") for o in outs) + "".join(o.get("evalue", "") for o in outs)
    return text, error


def execute_notebook(notebook: Path, record_dir: Path, timeout: int) -> None:
    """Execute a lesson notebook top to bottom in a fresh kernel with benchmarks/record_references.py's own
    `execute` (in the notebook's folder; what its Recorder measures is saved in record_dir), with the kernel-start
    retry."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_references", ROOT / "benchmarks" / "record_references.py")
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    retrying_kernel_start(lambda: recorder.execute(notebook, record_dir, timeout), notebook.name)()


def _compiled_cell(source: str, filename: str):
    """A cell compiled as IPython compiles one: its source kept in linecache under its file name, so tracebacks
    (and the checks' "line N of your code") show its lines."""
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    return compile(source, filename, "exec")


def notebook_functions(nb: dict, module: str, *names: str, tools: bool = False, solutions: bool = True,
                       replace: dict[str, str] | None = None) -> dict:
    """What a lesson's cells call, without running its cells: in one namespace named `module`, the setup cells
    (and with `tools`, the tools cell: the one that makes the Recorder) run whole; of every other code cell (not
    magics; solution cells only with `solutions`), only its imports, functions and UPPERCASE constants. `replace`
    maps a grade_id to a wrong answer in place of its solution block. Each cell's source is kept in linecache (so
    tracebacks and stacks, the ranks' too, show its lines). Asserts that the notebook still defines `names`."""
    ns: dict = {"__name__": module}
    for i, c in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        src = "".join(c["source"])
        gid = c["metadata"].get("nbgrader", {}).get("grade_id", "")
        filename = f"<{module} cell {i}>"
        if "setup" in c["metadata"].get("tags", []) or (tools and "Recorder(" in src):
            exec(_compiled_cell(src, filename), ns)
            continue
        if src.lstrip().startswith("%") or (not solutions and gid.endswith("_solution")):
            continue
        if replace and gid.endswith("_solution") and gid[: -len("_solution")] in replace:
            a, b = src.index("### BEGIN SOLUTION"), src.index("### END SOLUTION") + len("### END SOLUTION")
            src = src[:a].rstrip(" ") + replace[gid[: -len("_solution")]].rstrip("\n") + src[b:]
        keep = [n for n in ast.parse(src).body if isinstance(n, (ast.FunctionDef, ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in n.targets))]
        # the source of what runs, line for line, for tracebacks
        exec(_compiled_cell(ast.unparse(ast.Module(body=keep, type_ignores=[])), filename), ns)
    missing = [n for n in names if n not in ns]
    assert not missing, f"the notebook no longer defines {missing}"
    return ns


def run_in_process(sources: list[str], module: str, extra: str = "") -> tuple[str, str | None]:
    """Like run_cells, in this process (no kernel start), as module `module` (a name nothing can import, so
    cloudpickle ships the learner's functions and classes to ranks by value): the last cell's output and error
    name. `extra` runs after the setup and solution cells (to change a parameter), before the check cell."""
    ns: dict = {"__name__": module}
    out = io.StringIO()
    for i, src in enumerate(sources[:-1] + ([extra] if extra else [])):
        exec(_compiled_cell(src, f"<{module} cell {i}>"), ns)
    try:
        with contextlib.redirect_stdout(out):
            exec(_compiled_cell(sources[-1], f"<{module} check cell>"), ns)
    except Exception as err:  # noqa: BLE001 - the error's name is the verdict
        return out.getvalue() + str(err), type(err).__name__
    return out.getvalue(), None


def grade_answers(master: str | Path, answers: dict[str, str], grader=None):
    """Grade `master` with answers[grade_id] in place of its solution block(s) (None: the master's own), through
    course_utils.grading; returns the Grade. Pass a `grading.Grader` to reuse it across calls."""
    import tempfile

    import nbformat

    from course_utils import release
    from course_utils.grading import grade as grading

    master = Path(master)
    nb = release.substitute(nbformat.read(master, as_version=4),
                            {k: v for k, v in answers.items() if v is not None}, str(master))
    with tempfile.TemporaryDirectory(prefix="grade-answers-") as tmp:
        path = Path(tmp) / master.name
        path.write_text(release.dumps(nb))
        if grader is not None:
            return grader.grade(path, master)
        with grading.Grader() as own:
            return own.grade(path, master)


def notebook_function(nb: dict, name: str, namespace: dict):
    """The function `name` as a notebook cell defines it, compiled alone into `namespace` (which holds what it
    uses): for a function whose cell, or whose lesson's setup, needs what a test does not have (a pool, a GPU)."""
    for src in ("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"):
        if src.lstrip().startswith("%"):  # a magic: not Python
            continue
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                exec(compile(ast.Module([node], []), name, "exec"), namespace)
                return namespace[name]
    raise AssertionError(f"no cell defines {name}")

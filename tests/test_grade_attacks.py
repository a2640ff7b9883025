"""Submissions that attack the grader earn nothing; honest ones keep their points.

Targets are derived, not named: every exercise with a registered check in every master of notebooks/ and in
the fixture lesson gets the attacks of tests/fixtures/grading/attacks.py as its solution region (those on a
check's own workings on every lesson, those on the grader's pipeline on REPRESENTATIVE lessons; in a
function body the attack runs when the probe calls it; at module level when the cell runs). The grader runs
as the instructor would run it (`python -m course_utils.grade`), on copies: the package (first on PYTHONPATH),
the masters, the fixture's checks module and a home folder live in a temporary folder, so an attack that
got through would change only copies, and the tests see it.

On a GPU machine only the tampering runs (attacks on later submissions, then honest ones) grade with the GPUs;
the other runs hide them (CUDA_VISIBLE_DEVICES=""), as on a CPU machine. The attacks aim at the verdict path,
which is the same with or without a GPU; a GPU check's own defences (inputs built afresh, only the check's spans
counted) are tested by the lessons' wrong answers on the GPU. Graded with the GPUs, this file's hundred-odd
submissions would each wait their turn on a GPU (the grader times one check per GPU at a time).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import checks, gpu_lock, release
from course_utils.grading import assemble
from course_utils.grading.checks_modules import import_checks_module
from tests.launch_helpers import processes_with

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "grading"
sys.path.insert(0, str(FIXTURE_DIR))
import attacks  # noqa: E402  (tests/fixtures/grading/attacks.py)

sys.path.remove(str(FIXTURE_DIR))
# Each lesson's attacks are one grading run (a minute or two on the 2-core machine): the grader bounds each probe
# itself, and the suite's limit per test is a backstop for a hung grader.
pytestmark = [pytest.mark.slow, pytest.mark.grading, pytest.mark.timeout(1800)]
# The grade command, and its own peak memory (the probes' is not counted) printed at the end.
PEAK = ("import resource, sys\nfrom course_utils.grading.grade import main\ncode = main(sys.argv[1:])\n"
        "print(f'peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB')\nsys.exit(code)")

# Submissions graded at once in the runs that hide the GPUs: 2 on a 2-core CI machine, more where there are cores
# to spare (a GPU box), so the attack matrix does not hold up the whole suite there. What is asserted is the same.
CPU_JOBS = str(max(2, min(8, (os.cpu_count() or 2) // 4)))
MASTERS = sorted(ROOT.glob("notebooks/*.ipynb")) + [FIXTURE_DIR / "99_fixture.ipynb"]
import_checks_module(str(FIXTURE_DIR / "fixture_checks.py"))


def registered(master: assemble.Master) -> dict[str, str]:
    """{grade_id: entry} of the master's exercises that have a registered check."""
    out = {}
    for ex in master.exercises:
        try:
            out[ex.grade_id] = checks.exercise(ex.grade_id).entry
        except KeyError:
            pass
    return out


def _enclosing(lines: list[str], b: int) -> str:
    """What the block starting at line b sits in: "def" (a function body), "class" (a class body) or ""."""
    indent = len(lines[b]) - len(lines[b].lstrip())
    for line in reversed(lines[:b]):
        stripped = line.lstrip()
        if indent and stripped and len(line) - len(stripped) < indent:
            if re.match(r"(async\s+)?def\b", stripped):
                return "def"
            if stripped.startswith("class "):
                return "class"
            indent = len(line) - len(stripped)  # an if/for/with: look further out
    return ""


def indents(master: assemble.Master) -> dict[str, list[str]]:
    """For each exercise, for each of its solution blocks: "def", "class" or "" (see _enclosing)."""
    out = {}
    for ex in master.exercises:
        flags = []
        for i in ex.solutions:
            lines = master.source(i).split("\n")
            flags += [_enclosing(lines, b) for b, _ in release.solution_blocks(master.source(i), "master")]
        out[ex.grade_id] = flags
    return out


PARSED = {m.stem: assemble.read_master(m) for m in MASTERS}
TARGETS = {stem: registered(m) for stem, m in PARSED.items()}
ATTACKED = [stem for stem, t in TARGETS.items() if t]
# One lesson per kind of probe: the fixture's plain functions, a GPU lesson (its GPU check on a GPU machine), ranks
# started per case (launch.run), a pool of ranks per world size (launch.Pool), and loops on ranks beside inputs
# made of rank runs. For what acts on every exercise alike (the grader's limits on loops and floods; tampering with
# the masters, the package or the profile, which touches every lesson's files and is caught file by file too) these
# stand for all; each lesson more cost CI about a minute.
REPRESENTATIVE = [s for s in ("99_fixture", "01_host_and_device", "05_ranks_and_point_to_point",
                              "07_ring_allreduce", "10_debugging_distributed") if s in ATTACKED]
# Attacks on what only the grader's pipeline sees (the check cell's names, the kernel's feedback, the probe's exit,
# the files the sandbox shows) work the same way on every exercise of a kind of probe: they run against the
# REPRESENTATIVE lessons. Attacks on a check's own data, functions, timers and comparisons run against every lesson.
PIPELINE_ATTACKS = {"shadow_check", "input_transformer", "forge_kernel_replies", "pass_line_then_exit",
                    "read_master_solutions", "find_master_copies"}


def attacks_on(stem: str) -> list[str]:
    return [n for n in attacks.ATTACKS if stem in REPRESENTATIVE or n not in PIPELINE_ATTACKS]


PARAMS = [pytest.param(stem, marks=[] if TARGETS[stem] else pytest.mark.skip(
    reason=f"{stem}: no exercise with a registered check yet (its lesson still uses old-style check cells)"))
    for stem, m in PARSED.items() if m.exercises]


class Lab:
    """A copy of what grading reads (package, masters, checks module, home), and a grader command on it."""

    def __init__(self, base: Path):
        self.base = base
        self.pkg = base / "pkg"
        shutil.copytree(ROOT / "course_utils", self.pkg / "course_utils",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.masters = base / "masters"
        self.masters.mkdir()
        for m in MASTERS:
            shutil.copy(m, self.masters / m.name)
        self.checks_module = base / "checks" / "fixture_checks.py"
        self.checks_module.parent.mkdir()
        shutil.copy(FIXTURE_DIR / "fixture_checks.py", self.checks_module)
        # Copies of the masters where they lie about for real: JupyterLab's checkpoints beside them, and a test
        # suite's temp folder. Nothing of this is mounted in a probe.
        (self.masters / ".ipynb_checkpoints").mkdir()
        self.leftovers = base / "pytest-leftovers"
        self.leftovers.mkdir()
        for m in MASTERS:
            shutil.copy(m, self.masters / ".ipynb_checkpoints" / f"{m.stem}-checkpoint.ipynb")
            shutil.copy(m, self.leftovers / m.name)
        self.home = base / "home"
        self.home.mkdir()
        self.startup = self.home / ".ipython" / "profile_default" / "startup"
        # The grader's temp folder (run as root, its sandboxes go to /tmp: the uid they run as cannot walk into
        # pytest's folders).
        self.tmp = base / "tmp"
        self.tmp.mkdir()
        self.snapshot = self.files()

    def files(self) -> dict[str, bytes]:
        out = {}
        for root in (self.pkg, self.masters, self.checks_module.parent, self.home):
            for p in sorted(root.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    out[str(p.relative_to(self.base))] = p.read_bytes()
        return out

    def targets(self) -> dict:
        return {"masters": [str(self.masters / m.name) for m in MASTERS], "home": str(self.home),
                "check_modules": ["fixture_checks"], "search": [str(self.base), str(self.leftovers)]}

    def write(self, folder: str, stem: str, nb) -> None:
        path = self.base / folder / PARSED[stem].name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(release.dumps(nb))

    def attack(self, folder: str, stem: str, body: str) -> None:
        m = PARSED[stem]
        answers = attacks.attack_answers(m, indents(m), TARGETS[stem], body, self.targets())
        self.write(folder, stem, release.substitute(m.nb, answers, stem))

    def grade(self, folder: str, *args: str, env: dict | None = None, timeout: float = 900, gpus: bool = False):
        """Run the grader on base/folder; returns ({(submission folder, stem): {grade_id: (status, msg)}}, out).
        gpus=False hides the machine's GPUs from it (module docstring). The grader's command prints its own peak
        memory last ("peak RSS: N KiB")."""
        # The copied package comes first; what the environment had (the GPU machines' packages) after it.
        path = os.pathsep.join([str(self.pkg)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        environment = {**os.environ, "PYTHONPATH": path, "HOME": str(self.home),
                       "MPLCONFIGDIR": str(self.base / "mpl"),
                       "TMPDIR": str(self.tmp), gpu_lock.LOCK_DIR_ENV: str(gpu_lock.lock_dir()), **(env or {})}
        environment.pop("COURSE_CHECKS_MODULES", None)
        if not gpus:
            environment["CUDA_VISIBLE_DEVICES"] = ""
            environment.pop("COURSE_REQUIRE_GPU", None)
        xml = self.base / f"{folder}.xml"
        cmd = [sys.executable, "-c", PEAK, folder, "--master-dir", str(self.masters),
               "--checks-module", str(self.checks_module), "--junit", str(xml), *args]
        proc = subprocess.run(cmd, cwd=self.base, env=environment, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = {}
        for suite in ET.parse(xml).getroot().findall("testsuite"):
            path = Path(suite.get("name"))
            cases = {}
            for case in suite.findall("testcase"):
                failure, skipped = case.find("failure"), case.find("skipped")
                status = failure.get("type") if failure is not None else "skipped" if skipped is not None else "passed"
                cases[case.get("name")] = (status, (failure.get("message") if failure is not None else ""))
            out[path.parent.name, path.stem] = cases
        return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return Lab(tmp_path_factory.mktemp("attack_lab"))


def honest_statuses(gpus: bool = False) -> set[str]:
    """What an honest answer may score in a run with (gpus=True) or without the machine's GPUs."""
    return {"passed"} if gpus and checks.require_gpu_mode() else {"passed", "skipped"}


def assert_zero(results, folder: str, stem: str) -> None:
    got = results[folder, stem]
    scored = {gid: s for gid, s in got.items() if s[0] == "passed"}
    assert not scored, f"{folder} earned points on {stem}: {scored}"


# ---------------------------------------------------------------------------------------------- in-run attacks


@pytest.fixture(scope="module")
def attacked(lab, stem):
    """The attacks (attacks_on) against every registered exercise of one master, and the master itself: one run per
    lesson, so that no run's time limit depends on how many lessons there are (one run for all of them took 12
    minutes on the 2-core machine and passed its limit on a slower one)."""
    for name in attacks_on(stem):
        lab.attack(f"attack_{stem}/{name}", stem, attacks.ATTACKS[name])
    lab.write(f"attack_{stem}/honest", stem, PARSED[stem].nb)
    return lab.grade(f"attack_{stem}", "-j", CPU_JOBS)


@pytest.mark.parametrize("stem", PARAMS, scope="module")
@pytest.mark.parametrize("name", list(attacks.ATTACKS))
def test_attack_earns_nothing(attacked, stem, name):
    if name not in attacks_on(stem):
        pytest.skip(f"{name} attacks the grader's pipeline: run against {', '.join(REPRESENTATIVE)}")
    results, out = attacked
    assert_zero(results, name, stem)
    for gid in TARGETS[stem]:
        assert gid in results[name, stem], out[-2000:]


@pytest.mark.parametrize("stem", PARAMS, scope="module")
def test_honest_masters_keep_full_marks(attacked, stem):
    results, out = attacked
    got = results["honest", stem]
    for gid in TARGETS[stem]:
        assert got[gid][0] in honest_statuses(), (gid, got[gid], out[-3000:])
    for gid, (status, message) in got.items():
        if gid not in TARGETS[stem]:  # an exercise whose lesson has not moved to registered checks yet
            assert status == "failed" and "no check registered" in message


@pytest.mark.parametrize("stem", PARAMS, scope="module")
def test_attacks_leave_every_file_as_it_was(attacked, lab, stem):
    assert lab.files() == lab.snapshot


# ---------------------------------------------------------------------------------------------- later submissions


@pytest.fixture(scope="module")
def tampered(lab):
    """One run, one job: attacks on the masters, the package and the IPython profile, then `pass` answers."""
    for name, body in attacks.TAMPER.items():
        lab.attack(f"tamper/a_{name}", "99_fixture", body)
    for stem in REPRESENTATIVE:
        m = PARSED[stem]
        lab.write("tamper/z_pass", stem, release.substitute(m.nb, {gid: "pass" for gid in TARGETS[stem]}, stem))
    first = lab.grade("tamper", "-j", "1", gpus=True)
    files_after_first = lab.files()
    for stem in REPRESENTATIVE:
        m = PARSED[stem]
        lab.write("later/z_pass", stem, release.substitute(m.nb, {gid: "pass" for gid in TARGETS[stem]}, stem))
        lab.write("later/honest", stem, m.nb)
    # a fresh grader run: it reads the masters and imports the checks again
    later = lab.grade("later", "-j", "2", gpus=True)
    return first, files_after_first, later


def test_tampering_attacks_earn_nothing(tampered):
    (results, out), _, _ = tampered
    for name in attacks.TAMPER:
        assert_zero(results, f"a_{name}", "99_fixture")


@pytest.mark.parametrize("stem", REPRESENTATIVE)
def test_a_pass_graded_after_tampering_earns_nothing(tampered, stem):
    (results, _), _, (later, out) = tampered
    assert_zero(results, "z_pass", stem)
    assert_zero(later, "z_pass", stem)
    for gid in TARGETS[stem]:
        got = later["honest", stem][gid]
        assert got[0] in honest_statuses(gpus=True), (gid, got, out[-3000:])


def test_tampering_changed_no_file(tampered, lab):
    _, files, _ = tampered
    assert files == lab.snapshot
    assert not lab.startup.exists() or not any(lab.startup.iterdir())


# ---------------------------------------------------------------------------------------------- sandbox escapes

SECRET = "the-graders-jupyter-token"
# Regions for the fixture's `add(a, b)`: each returns the right sum only if its escape worked, else a wrong one.
ESCAPES = {
    # As root, this once piped every later core dump into the attacker's script, run by the kernel as root.
    "core_pattern": """    try:
        with open("/proc/sys/kernel/core_pattern", "w") as _f:
            _f.write("|/bin/true {marker}")
        return a + b
    except OSError:
        return a - b""",
    # A setsid'd orphan: it once lived on, as the grader's user, and overwrote later probes' rendezvous keys.
    "orphan": """    import subprocess, sys
    subprocess.Popen([sys.executable, "-c",
                      "import os, time\\nif os.fork():\\n    os._exit(0)\\nos.setsid()\\ntime.sleep(600)  # {marker}"])
    return a - b""",
    # The grader's environment (a Jupyter token) through any /proc/*/environ it can read.
    "environ": """    import os
    seen = b""
    for p in ["self"] + [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            seen += open(f"/proc/{{p}}/environ", "rb").read()
        except OSError:
            pass
    return a + b if b"{secret}" in seen else a - b""",
    # A 1 MiB-odd frame that decodes to 2 GiB: written on the result pipe in place of the probe's own result.
    "decompression_bomb": """    import io, os, stat, struct, torch, zipfile
    buf = io.BytesIO()
    torch.save({{"status": "ok", "data": {{"out": torch.zeros(1)}}}}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                with dst.open(info.filename, "w", force_zip64=True) as record:
                    for _ in range(2048):
                        record.write(bytes(1 << 20))
            else:
                dst.writestr(info.filename, src.read(info))
    frame = out.getvalue()
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, struct.pack(">Q", len(frame)) + frame)
        except OSError:
            pass
    os._exit(0)""",
    # A channel between probes: one writes into /dev/shm, a later one reads it.
    "shm_writer": """    open("/dev/shm/{marker}", "w").write("a + b")
    return a - b""",
    "shm_reader": """    import os
    return a + b if os.path.exists("/dev/shm/{marker}") else a - b""",
}


def test_escapes_from_the_sandbox_earn_nothing_and_leave_nothing(lab):
    """Each finding of the last attack on the grader, as a submission graded beside honest ones in one run (with
    feedback notebooks, where the orphan runs too): the attackers earn nothing, the honest students keep full
    marks, no attacker's process outlives the run, the kernel's settings and our files are unchanged, and the
    grader's memory stays far below what the bomb would decode to."""
    marker = f"escape-{uuid.uuid4().hex}"
    m = PARSED["99_fixture"]
    stubs = {gid: release.STUB for gid in TARGETS["99_fixture"]}
    lab.write("escape/a_honest", "99_fixture", m.nb)
    for name, body in ESCAPES.items():
        nb = release.substitute(m.nb, {**stubs, "ex99_add": body.format(marker=marker, secret=SECRET)}, "99_fixture")
        lab.write(f"escape/{'b' if name != 'shm_reader' else 'c'}_{name}", "99_fixture", nb)
    lab.write("escape/z_honest", "99_fixture", m.nb)
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    try:
        results, out = lab.grade("escape", "-j", "1", "--executed-dir", str(lab.base / "escape_feedback"),
                                 env={"JUPYTER_TOKEN": SECRET})
    finally:
        if Path("/proc/sys/kernel/core_pattern").read_text() != core_pattern:
            Path("/proc/sys/kernel/core_pattern").write_text(core_pattern)
            pytest.fail("a probe changed kernel.core_pattern (put back)")
    for name in ESCAPES:
        folder = f"{'b' if name != 'shm_reader' else 'c'}_{name}"
        assert results[folder, "99_fixture"]["ex99_add"][0] == "failed", (name, results[folder, "99_fixture"])
    for honest in ("a_honest", "z_honest"):
        for gid in TARGETS["99_fixture"]:
            assert results[honest, "99_fixture"][gid][0] in honest_statuses(), (honest, gid, out[-3000:])
    assert "compressed" in results["b_decompression_bomb", "99_fixture"]["ex99_add"][1]
    assert processes_with(marker) == [], "an attacker's process outlived the grader"
    assert not list(Path("/dev/shm").glob(f"{marker}*"))
    assert lab.files() == lab.snapshot
    peak_kib = int(re.search(r"peak RSS: (\d+) KiB", out).group(1))
    assert peak_kib < 1_500_000, f"the grader's peak memory was {peak_kib >> 10} MiB"


# ---------------------------------------------------------------------------------------------- limits


def _leftovers(tmp: Path) -> list[int]:
    """Processes still running in one of the throwaway folders of a grader whose TMPDIR is `tmp`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cwd = os.readlink(proc / "cwd")
            except OSError:
                continue
            if cwd.startswith(str(tmp) + os.sep) and ("course-probe-" in cwd or "course-notebook-" in cwd):
                found.append(int(proc.name))
    return found


def test_loops_and_floods_are_cut_off(lab):
    assert len(REPRESENTATIVE) == 5, REPRESENTATIVE
    for stem in REPRESENTATIVE:
        for name, body in attacks.LIMITS.items():
            lab.attack(f"limits/{name}", stem, body)
    before = set(_leftovers(lab.tmp))
    t0 = time.monotonic()
    results, out = lab.grade("limits", "-j", CPU_JOBS, "--cell-timeout", "4")
    seconds = time.monotonic() - t0
    for stem in REPRESENTATIVE:
        for name in attacks.LIMITS:
            assert_zero(results, name, stem)
        for gid in TARGETS[stem]:
            status, message = results["infinite_loop", stem][gid]
            if status == "failed":
                assert "time limit of 4 s" in message, message
    # Cut off, not left to run: a loop that was not stopped would hold its submission for the whole --timeout
    # (600 s). Each probe also starts a fresh Python that imports torch, a few seconds on a loaded 2-core machine.
    n_probes = sum(len(TARGETS[s]) for s in REPRESENTATIVE)
    assert seconds < 60 + 10 * n_probes, out[-2000:]
    time.sleep(0.5)
    assert set(_leftovers(lab.tmp)) - before == set()


# ---------------------------------------------------------------------------------------------- the kernel is fooled


FOOLS_A_KERNEL = ["shadow_check", "input_transformer", "forge_kernel_replies", "replace_check_functions"]


def test_attacks_that_fool_a_kernel_still_earn_nothing(lab):
    """In the feedback notebook (a kernel running the check cells) these attacks look like passes (no error, no
    skip line, sometimes the pass line): a grader that trusted the kernel would give points. This one gives none.
    Shown on the fixture's exercise whose region is at module level (so the attack runs before its check cell)."""
    m = PARSED["99_fixture"]
    ex = next(e for e in m.exercises if e.grade_id in TARGETS["99_fixture"] and not any(indents(m)[e.grade_id]))
    for name in FOOLS_A_KERNEL:
        lab.attack(f"fool/{name}", "99_fixture", attacks.ATTACKS[name])
    executed = lab.base / "executed"
    results, out = lab.grade("fool", "-j", CPU_JOBS, "--executed-dir", str(executed))
    for name in FOOLS_A_KERNEL:
        assert_zero(results, name, "99_fixture")
        (path,) = executed.glob(f"fool__{name}__*.ipynb")
        check_cell = nbformat.read(path, as_version=4).cells[ex.check_index]
        kinds = [o.get("output_type") for o in check_cell.outputs]
        text = "".join(o.get("text", "") for o in check_cell.outputs)
        assert "error" not in kinds and "skipped" not in text, (name, check_cell.outputs)
        if name == "shadow_check":
            assert f"passed: {ex.grade_id}" in text
    assert lab.files() == lab.snapshot

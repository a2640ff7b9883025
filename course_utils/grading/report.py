"""Grades and how they are reported: a table per submission, a CSV for the class, JUnit XML for CI systems."""

from __future__ import annotations

import csv
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PASSED, FAILED, SKIPPED, NOT_ATTEMPTED = "passed", "failed", "skipped", "not attempted"


@dataclass
class ExerciseResult:
    grade_id: str
    points: float
    score: float
    status: str
    message: str = ""


@dataclass
class Grade:
    submission: str
    master: str
    exercises: list[ExerciseResult] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str = ""  # why grading ended early (unreadable submission, time limit), empty otherwise
    notes: list[str] = field(default_factory=list)  # for the instructor: feedback run, files put back, ...

    @property
    def total(self) -> float:
        return sum(r.score for r in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(r.points for r in self.exercises)

    @property
    def skipped_points(self) -> float:
        return sum(r.points for r in self.exercises if r.status == SKIPPED)

    def by_id(self) -> dict[str, ExerciseResult]:
        return {r.grade_id: r for r in self.exercises}


def _num(x: float) -> str:
    return f"{x:g}"


def student(submission: str) -> str:
    """Who a submission is from: the name of its folder (one folder per student), else its file's stem."""
    path = Path(submission)
    return path.parent.name or path.stem


def format_table(grade: Grade, verbose: bool = False) -> str:
    """The submission's exercises, points, statuses and messages (cut to 200 characters unless `verbose`)."""
    width = max([len("exercise")] + [len(r.grade_id) for r in grade.exercises])
    lines = [f"{grade.submission}  (master {grade.master}, {grade.seconds:.1f} s)"]
    if grade.stopped:
        lines.append(f"  stopped early: {grade.stopped}")
    lines.append(f"  {'exercise':<{width}}  {'points':>7}  {'status':<13}  message")
    for r in grade.exercises:
        msg = " ".join(r.message.split())
        msg = msg if verbose or len(msg) <= 200 else msg[:197] + "... (--verbose shows all)"
        pts = f"{_num(r.score)}/{_num(r.points)}"
        lines.append(f"  {r.grade_id:<{width}}  {pts:>7}  {r.status:<13}  {msg}".rstrip())
    total = f"{_num(grade.total)}/{_num(grade.max_points)}"
    extra = f"  ({_num(grade.skipped_points)} points skipped: they need a GPU)" if grade.skipped_points else ""
    lines.append(f"  {'total':<{width}}  {total:>7}{extra}")
    lines += [f"  note: {n}" for n in grade.notes]
    return "\n".join(lines)


def write_csv(grades: list[Grade], path: str | os.PathLike) -> None:
    """One row per submission: the student, its score on each exercise, total, max, and what did not pass and why."""
    ids: list[str] = []
    for g in grades:
        ids += [r.grade_id for r in g.exercises if r.grade_id not in ids]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["student", "submission", "master", *ids, "total", "max", "notes"])
        for g in grades:
            got = g.by_id()
            notes = [f"{r.grade_id}: {r.status}" + (f" ({' '.join(r.message.split())[:300]})" if r.message else "")
                     for r in g.exercises if r.status != PASSED]
            if g.stopped:
                notes.insert(0, g.stopped)
            row = [student(g.submission), g.submission, Path(g.master).name]
            row += [_num(got[i].score) if i in got else "" for i in ids]
            writer.writerow(row + [_num(g.total), _num(g.max_points), "; ".join(notes)])


def write_junit(grades: list[Grade], path: str | os.PathLike) -> None:
    """JUnit XML: a test suite per submission, a test case per exercise (not attempted counts as a failure)."""
    root = ET.Element("testsuites", name="course_utils.grade")
    for g in grades:
        failures = sum(r.status in (FAILED, NOT_ATTEMPTED) for r in g.exercises)
        skipped = sum(r.status == SKIPPED for r in g.exercises)
        suite = ET.SubElement(root, "testsuite", name=g.submission, tests=str(len(g.exercises)),
                              failures=str(failures), errors="0", skipped=str(skipped), time=f"{g.seconds:.3f}")
        props = ET.SubElement(suite, "properties")
        for key, value in (("master", g.master), ("score", _num(g.total)), ("max", _num(g.max_points)),
                           ("stopped", g.stopped)):
            ET.SubElement(props, "property", name=key, value=value)
        for r in g.exercises:
            case = ET.SubElement(suite, "testcase", classname=Path(g.master).stem, name=r.grade_id)
            cprops = ET.SubElement(case, "properties")
            ET.SubElement(cprops, "property", name="points", value=_num(r.points))
            ET.SubElement(cprops, "property", name="score", value=_num(r.score))
            if r.status in (FAILED, NOT_ATTEMPTED):
                ET.SubElement(case, "failure", type=r.status, message=r.message or r.status).text = r.message
            elif r.status == SKIPPED:
                ET.SubElement(case, "skipped", message=r.message)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)

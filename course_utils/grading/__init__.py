"""Release and grading: student versions of the masters, and verdicts the student's code cannot reach.

- release.py    student versions (`python -m course_utils.release notebooks/ student/`)
- assemble.py   what runs: the master's cells, only the solution regions taken from a submission
- probe.py      one exercise's probe in a sandboxed process of its own (grader side), result as bytes
- probe_child.py  the probe itself (`python -m course_utils.grading.probe_child`, inside the sandbox)
- sandbox.py    throwaway folders and the bubblewrap command line that confines students' code
- checks_modules.py  importing the modules that register exercises
- grader.py     the Grader: masters read once, a probe per exercise, verdicts decided here
- notebook.py   running a whole notebook in a sandboxed kernel (feedback only)
- grade.py      the grader and its command (`python -m course_utils.grade ...`)
- report.py     tables, CSV, JUnit XML

This package imports nothing on import: `python -m course_utils.grading.probe_child` starts in every probe.
"""

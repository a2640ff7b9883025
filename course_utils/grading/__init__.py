"""Release and grading: student versions of the masters, and verdicts the student's code cannot reach.

- release.py    student versions (`python -m course_utils.release notebooks/ student/`)
- assemble.py   what runs: the master's cells, only the solution regions taken from a submission
- probe.py      one exercise's probe in a throwaway process (forked by probe_server.py), result as bytes
- sandbox.py    throwaway folders, Landlock write fence, killing process trees, guarding files
- notebook.py   running a whole notebook in a sandboxed kernel (feedback only)
- grade.py      the grader and its command (`python -m course_utils.grade ...`)
- report.py     tables, CSV, JUnit XML

This package imports nothing on import: `python -m course_utils.grading.sandbox` starts every feedback kernel.
"""

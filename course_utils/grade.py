"""`python -m course_utils.grade SUBMISSIONS... [options]`: score submissions (see course_utils.grading.grade).

The code lives in course_utils.grading; this module keeps the command and the imports working."""

from __future__ import annotations

import sys

from .grading.grade import find_master, main  # noqa: F401  (re-exported)
from .grading.grader import GradeError, Grader, Options  # noqa: F401  (re-exported)
from .grading.report import (  # noqa: F401  (re-exported)
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    SKIPPED,
    ExerciseResult,
    Grade,
    format_table,
    write_csv,
    write_junit,
)

if __name__ == "__main__":
    sys.exit(main())

"""`python -m course_utils.release notebooks/ OUT/`: student versions of the masters.

The code lives in course_utils.grading.release; this module keeps the command and the imports working."""

from __future__ import annotations

import sys

from .grading.release import (  # noqa: F401  (re-exported)
    BEGIN,
    END,
    NEXT_BLOCK,
    STUB,
    Exercise,
    ReleaseError,
    dumps,
    exercises,
    is_check_cell,
    is_solution_cell,
    main,
    nbgrader_meta,
    release,
    replace_blocks,
    solution_blocks,
    student_version,
    substitute,
    unsolved_master,
)

if __name__ == "__main__":
    sys.exit(main())

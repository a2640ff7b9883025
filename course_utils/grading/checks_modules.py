"""Importing the modules that register exercises: every lesson's, and those an instructor names.

Used by the grader (its judges) and by each probe (its probe functions), so both see the same registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

CHECKS_MODULES_ENV = "COURSE_CHECKS_MODULES"  # the grade command's default for --checks-module


def import_checks_module(spec: str):
    """Import a module that registers exercises: a dotted name, or a path to a .py file (imported under its
    file name's stem, so a notebook's `import <stem>` finds the same module and registry)."""
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).resolve()
        if path.stem in sys.modules and getattr(sys.modules[path.stem], "__file__", None) == str(path):
            return sys.modules[path.stem]
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise ImportError(f"no Python file at {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[path.stem]
            raise
        return module
    return importlib.import_module(spec)


def load_checks(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Import every lesson's checks module and the `extra` ones; return the errors (a broken module must not
    stop the grading of the others: its exercises are then reported as having no check)."""
    from course_utils import checks

    errors = []
    for name in checks.lesson_modules():
        try:
            importlib.import_module(f"course_utils.checks.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"course_utils.checks.{name}":
                errors.append(f"course_utils.checks.{name}: {err}")
        except Exception as err:
            errors.append(f"course_utils.checks.{name}: {type(err).__name__}: {err}")
    for spec in extra:
        try:
            import_checks_module(spec)
        except Exception as err:
            errors.append(f"{spec}: {type(err).__name__}: {err}")
    return errors

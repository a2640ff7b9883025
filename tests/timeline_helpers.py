"""What the timeline tests share: hand-built spans, and every figure closed after each test."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before pyplot: the tests render on machines without a display

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils.timeline import Span  # noqa: E402


def S(name, kind, start, end, stream="s", rank=0):
    """A span by hand: name, kind, start and end in ms, on stream `stream` of rank `rank`."""
    return Span(name, kind, rank, stream, float(start), float(end))


@pytest.fixture(autouse=True)
def close_figures():
    """Autouse wherever it is imported: a test's figures do not pile up in the next one."""
    yield
    plt.close("all")

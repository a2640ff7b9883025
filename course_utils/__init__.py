"""Helpers for the course: hardware facts, launching ranks from a cell, timelines, checks."""

__version__ = "0.1.0"

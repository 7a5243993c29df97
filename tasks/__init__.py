"""Prefect tasks, one module per stage: thin wrappers around plain, testable code."""

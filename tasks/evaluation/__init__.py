"""Plain evaluation code: lm-eval runs, results keyed by model content, the report card."""

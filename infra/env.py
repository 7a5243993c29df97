"""Process-wide defaults for running offline on small machines; explicit settings win."""

import os

OFFLINE_DEFAULTS = {
    # Prefect and the HF hub would otherwise phone home or retry unreachable hosts
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # the ephemeral API server needs 20-50 s to start on a loaded 2-core machine; the default is 20 s
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # show the project's own log lines (step skipped or built, counts) in flow run logs
    "PREFECT_LOGGING_EXTRA_LOGGERS": "infra,tasks,model,postrain",
}


def apply_offline_defaults() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)

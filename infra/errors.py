"""Errors a user can act on. Prefect tasks do not retry them: rerunning cannot fix the input."""


class SmolflowError(Exception):
    """Base class; its message is meant for the user, so the CLI prints it without a traceback."""

    retryable = False


class DataError(SmolflowError):
    """Input data that cannot be used: the message names the source, file and line."""


class UpstreamMissing(SmolflowError):
    """A stage was asked to run before the step it reads from."""


class StepLocked(SmolflowError):
    """Another live process is building the same step (a double launch): this one stands down."""


class TrainerFailed(SmolflowError):
    """A launched trainer exited non-zero or unfinished: a retry resumes it from its newest checkpoint."""

    retryable = True

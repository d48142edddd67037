"""The exceptions a user can act on: the CLI prints them as one line each (exit 2 or 1)."""

import errno


class KilnError(Exception):
    """Bad input (config, data, checkpoint, CLI): message names the field, value and what is allowed."""


class RunStopped(Exception):
    """A run that cannot go on (e.g. too many non-finite steps): the CLI prints it and exits 1."""


class WriteFailed(RunStopped):
    """A write that failed (`write_error`); `error` is the OSError behind it, for a caller that
    reports it under another path (a staging directory's file under the output it becomes)."""

    def __init__(self, message: str, error: OSError):
        super().__init__(message)
        self.error = error

    def __reduce__(self):  # across processes (pickle) with its error: args hold the message only
        return type(self), (str(self), self.error)


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its type's name if it has none), at most
    `limit` characters: a library's error inside one line of kiln's."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:limit]


def write_error(
    e: OSError, path: object, kept: int | str | None = "", *, then: str | None = None
) -> WriteFailed:
    """A failed write to a run's files as one line; a full disk (or quota) says so.

    `kept`: the step of the last complete checkpoint, None if there is none ("" = not known).
    `then`: what running the same command again does, for files other than a run's.
    """
    resume = "resume from the last complete checkpoint"
    if kept is None:
        resume = "start over (there is no complete checkpoint yet)"
    elif kept != "":
        resume += f" (step {kept})"
    resume = then or resume
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return WriteFailed(
            f"no space left on device writing {path}; nothing half-written was kept: free "
            f"space, then run the same command again to {resume}",
            e,
        )
    return WriteFailed(
        f"cannot write {path}: {e.strerror or e}; nothing half-written was kept: fix the "
        f"directory, then run the same command again to {resume}",
        e,
    )

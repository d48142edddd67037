"""A file written whole or not at all, even when a signal ends the process mid-write."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kiln.util.interrupt import on_interrupt


def write_whole(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to `path` through a temporary file beside it, renamed into
    place: a failure, an exception or an interrupt (`kiln.util.interrupt`) leaves no partial
    `path`. The temporary's name holds the host and pid, so writers on a shared filesystem do
    not meet."""
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    forget = on_interrupt(lambda: tmp.unlink(missing_ok=True))
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        forget()

"""Which accelerators the machine has, read from their device files before JAX starts.

JAX with no `JAX_PLATFORMS` tries every backend it knows; with libtpu installed (the `dev` and
`tpu` extras) that starts libtpu, which on a machine without a TPU prints its own errors to
stderr before JAX falls back to the CPU. The device files are the ones the runtimes open: a TPU
chip is `/dev/accel*` (v2-v4) or a numbered `/dev/vfio/*` group (v5e and later); a GPU is
`/dev/nvidia0`, `/dev/nvidiactl`, `/dev/dxg` (WSL2) or `/dev/kfd` (ROCm), as JAX checks them.

`import kiln` runs `cpu_by_default`, so the `kiln` command and a Python process that imports
kiln make the same choice. This module imports nothing of kiln: the package's `__init__` uses it.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping

TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def tpu_attached() -> bool:
    """Whether a TPU chip's device file exists on this machine."""
    return any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES)


def accelerator_attached() -> bool:
    """Whether a TPU or GPU device file exists on this machine."""
    return tpu_attached() or any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def cpu_unless_attached(environ: MutableMapping[str, str]) -> None:
    """Set `JAX_PLATFORMS=cpu` in `environ` when no accelerator is attached and none is chosen.

    A `JAX_PLATFORMS` already in `environ` (even empty: JAX's automatic choice) is the user's and
    is kept. Compiling for a TPU topology loads libtpu by itself and needs no TPU backend.
    """
    if "JAX_PLATFORMS" not in environ and not accelerator_attached():
        environ["JAX_PLATFORMS"] = "cpu"


def cpu_by_default() -> None:
    """`cpu_unless_attached` for this process, in its environment and, when JAX was imported
    first (it reads `JAX_PLATFORMS` once, at import), in JAX's config too.

    A platform chosen in JAX's config is kept. Once JAX's backends have started, its config no
    longer changes them: the choice has to come before the first JAX computation.
    """
    if "JAX_PLATFORMS" in os.environ:
        return
    cpu_unless_attached(os.environ)
    jax = sys.modules.get("jax")
    if "JAX_PLATFORMS" in os.environ and jax is not None and jax.config.jax_platforms is None:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

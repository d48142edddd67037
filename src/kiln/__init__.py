"""kiln: end-to-end LLM pre-training and distillation on JAX.

Importing kiln makes the `kiln` command's platform choice for the process: JAX's CPU backend on
a machine with no TPU or GPU device file, unless `JAX_PLATFORMS` (or JAX's config) names a
platform (`kiln.util.platforms.cpu_by_default`). An installed libtpu then stays unloaded there,
instead of printing its errors before JAX falls back to the CPU.
"""

from kiln.util import platforms

__version__ = "0.1.0"

platforms.cpu_by_default()

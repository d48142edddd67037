"""Run-time knobs around the loop: the persistent compilation cache and jax.profiler traces."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from kiln.config import Config

# Compilations that JAX looked up in the persistent cache, by outcome (jax.monitoring events).
_CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}
cache_events: Counter[str] = Counter()
_listening = False


def _count(event: str, **_kwargs) -> None:
    if event in _CACHE_EVENTS:
        cache_events[_CACHE_EVENTS[event]] += 1


def cache_dir(config: Config) -> Path | None:
    """Where the run's compiled programs are kept: relative paths are under train.output_dir."""
    path = config.train.compilation_cache_dir
    return None if path is None else config.local_output_dir / path


@contextmanager
def compilation_cache_for(config: Config) -> Iterator[Path | None]:
    """Within the block, JAX reads and writes compiled programs in `cache_dir(config)`.

    Every program is cached, however fast it compiled or small it is (JAX's defaults skip
    those under a second, which on CPU is nearly all of them). The previous settings come
    back afterwards, so a test process that runs several configs keeps its own.
    """
    global _listening
    path = cache_dir(config)
    if not _listening:
        jax.monitoring.register_event_listener(_count)
        _listening = True
    cache_events.clear()  # from here on, this run's compilations
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    new = (None if path is None else str(path.resolve()), 0.0, -1)
    compilation_cache.reset_cache()  # JAX opens its cache once, at the first compilation
    for name, value in zip(names, new):
        jax.config.update(name, value)
    try:
        yield path
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


class ProfileWindow:
    """A jax.profiler trace of steps [start, stop] into `log_dir`, started and ended by the loop.

    Before the first traced step and after the last, the loop waits for the device, so the
    trace holds those steps' work and nothing of their neighbours'.
    """

    def __init__(self, steps: tuple[int, int] | None, log_dir: Path, first_step: int):
        # A run resumed inside the window traces what is left of it.
        self.start = None if steps is None else max(steps[0], first_step)
        self.stop = None if steps is None else steps[1]
        self.log_dir, self.active = log_dir, False

    def edge(self, step: int) -> bool:
        """Whether `before` or `after` starts or ends the trace at `step` (they wait then)."""
        return self.start is not None and step in (self.start, self.stop)

    def before(self, step: int, state) -> None:
        """Call before dispatching `step`, with the state it starts from."""
        if self.start is not None and step == self.start <= self.stop:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs) -> None:
        """Call after dispatching `step`, with what it returned."""
        if self.active and step == self.stop:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """End the trace (if one is running) and write it."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

"""Test set-up: 8 simulated CPU devices, float32 matmuls at full precision; shared helpers.

Test modules import the helpers with `from conftest import kiln, make_config, ...`.
"""

import atexit
import contextlib
import copy
import gc
import hashlib
import importlib
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock
import fsspec
import psutil
import pytest

# The suite's programs are tiny, so compiling them is most of its time and running them little
# of it. XLA:CPU compiles them here without LLVM's optimisation of the machine code and with its
# older loop emitters instead of the MLIR fusion emitters: a third of the compile time, the same
# HLO passes, the same collectives and shardings, float32 results within the tolerances every
# test states. Buffer assignment can differ by a few bytes, so the docs' recorded compile
# figures are checked in `kiln` processes with XLA's own flags (tests/test_docs.py).
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",  # the workers already keep the cores busy
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite starts some hundred `kiln` processes, each importing kiln's modules; where the
# environment turns bytecode caching off (PYTHONDONTWRITEBYTECODE), each would compile them
# again (0.15-0.2 CPU s a process). The suite turns it on for itself and its subprocesses: the
# .pyc files go to the __pycache__ directories git ignores.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _programs_dir() -> str:
    """The run's one persistent compilation cache, made by the first process of the run (pytest
    itself, or xdist's controller) and inherited by its workers and their subprocesses through
    the environment. Named by the JAX version and a hash of kiln's source, so that two runs
    never mix; removed when the process that made it exits."""
    if os.environ.get("KILN_TEST_PROGRAMS"):
        return os.environ["KILN_TEST_PROGRAMS"]
    src = Path(__file__).resolve().parents[1] / "src"
    digest = hashlib.sha256()
    for path in sorted(src.rglob("*.py")):
        digest.update(path.read_bytes())
    version = importlib.metadata.version("jax")
    path = tempfile.mkdtemp(prefix=f"kiln-tests-jax-{version}-{digest.hexdigest()[:12]}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["KILN_TEST_PROGRAMS"] = path
    return path


# Programs that took 50 ms or more to compile are cached (JAX's default is a second, which on CPU
# is nearly none of them); below that, recompiling is cheaper than writing and reading a file,
# as for the single operations of eager reference code. A run caches every program
# (kiln.training.profiling), in this cache too (`config_dict`). Set through JAX's own
# environment variables, so `kiln` subprocesses use the cache as well. No size bound: with one,
# JAX lists the whole directory at every write to find what to evict. A read that meets a file
# another process is still writing fails to decompress, and JAX compiles the program instead
# (with a warning).
PROGRAMS = Path(_programs_dir())
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(PROGRAMS)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.05"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402 - after the environment above, which JAX reads when imported
import jax.extend  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = Path(__file__).resolve().parents[1]
# XLA's own flags, with the tests' 8 devices: for a process whose timing is what a test depends
# on, as a user's would be.
USER_XLA_FLAGS = "--xla_force_host_platform_device_count=8"


def xla_flags_with(devices: int) -> str:
    """The tests' XLA_FLAGS with `devices` simulated CPU devices instead of 8: for a `kiln`
    subprocess whose subject is not sharding and whose results are compared with no 8-device
    run (fewer devices cost less CPU time, above all in multi-process collectives)."""
    return os.environ["XLA_FLAGS"].replace("device_count=8", f"device_count={devices}")


def with_expert(shape: Sequence[int]) -> tuple[int, ...]:
    """Mesh sizes in kiln's axis order (stage, data, fsdp, expert, tensor, sequence) from the
    sizes of (data, fsdp, tensor, sequence): stage = expert = 1."""
    data, fsdp, tensor, sequence = shape
    return (1, data, fsdp, 1, tensor, sequence)


# Subprocesses import the kiln this process imported (e.g. a checkout's src/ on PYTHONPATH),
# not whichever copy is installed.
KILN_SRC = Path(importlib.import_module("kiln").__file__).resolve().parents[1]


def kiln_env(**extra: str | None) -> dict[str, str]:
    """The environment of a `kiln` subprocess: this one, with this process's kiln first;
    `extra` sets variables, or removes those given as None."""
    path = os.pathsep.join(p for p in (str(KILN_SRC), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, **extra}
    return {k: v for k, v in env.items() if v is not None}


# A process under test is stuck when it has used no CPU time for this long. Tests wait for a
# process as long as it works, not for a wall-clock budget: on a loaded machine a run takes
# several times as long as on an idle one, but a working process always gains CPU time.
STALL_S = 120.0


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by a process and its live descendants (0 once it has gone)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def wait_until(
    done: Callable[[], bool], proc: subprocess.Popen | None = None, what: str = ""
) -> None:
    """Return once `done()` holds. Fails if `proc` exits first, or if it (or, with no process,
    the wait itself) shows no progress, as CPU time, for `STALL_S` seconds."""
    last = cpu_seconds(proc.pid) if proc else 0.0
    moved = read = time.monotonic()
    while not done():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what or 'the condition'}: process exited {proc.returncode}")
        # The process tree's CPU time is read once a second, not at every look at `done`: a
        # reading walks every process of the machine, and a stall is STALL_S long.
        if time.monotonic() - read >= 1.0:
            now, read = (cpu_seconds(proc.pid) if proc else last), time.monotonic()
            if now > last:
                last, moved = now, read
            elif read - moved > STALL_S:
                raise AssertionError(f"{what or 'the condition'}: no progress in {STALL_S:.0f} s")
        time.sleep(0.02)


def communicate(proc: subprocess.Popen, input: str | None = None) -> tuple[str, str]:
    """`proc.communicate()`, waiting as long as the process uses CPU time; a process that
    stalls for `STALL_S` seconds is killed and the test fails."""
    last = -1.0
    while True:
        try:
            return proc.communicate(input, timeout=STALL_S)
        except subprocess.TimeoutExpired:
            input = None  # sent with the first call
            now = cpu_seconds(proc.pid)
            if now <= last:
                proc.kill()
                err = proc.communicate()[1] or ""
                raise AssertionError(
                    f"stuck: no CPU time in {STALL_S:.0f} s\n{err[-3000:]}"
                ) from None
            last = now


def run_process(cmd: Sequence[str], **popen: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, **popen)`, waiting as `communicate`
    does instead of for a fixed time."""
    with subprocess.Popen(
        list(cmd),
        stdin=subprocess.PIPE if "input" in popen else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **{k: v for k, v in popen.items() if k != "input"},
    ) as proc:
        out, err = communicate(proc, popen.get("input"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kiln(
    *args: Any, cwd: str | Path | None = None, env: Mapping | None = None
) -> subprocess.CompletedProcess:
    """Run the `kiln` command in a subprocess, as a user would; output captured as text."""
    return run_process(
        [sys.executable, "-m", "kiln.cli", *map(str, args)],
        cwd=cwd,
        env=kiln_env(**(env or {})),
    )


def kiln_main(*args: Any, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`kiln ARGS` in this process: exit code, stdout and stderr as `kiln` returns them, its
    programs compiled as `kiln` compiles them (JAX's default matmul precision, not this
    process's), so that they are the ones a `kiln` subprocess reads from the shared cache and
    computes bitwise alike. For tests of what a command does and says; what the process shows
    (no traceback, no stray output at start-up, signals) is checked with `kiln` by at least one
    test of each command."""
    from kiln.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = contextlib.chdir(cwd or os.getcwd())
    precision = jax.default_matmul_precision(None)
    with here, precision, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(
        ["kiln", *map(str, args)], code, out.getvalue(), err.getvalue()
    )


def start_kiln(
    *args: Any, cwd: str | Path | None = None, merged: bool = False, env: Mapping | None = None
) -> subprocess.Popen:
    """Start the `kiln` command without waiting (to signal or kill it); pipes as text.
    `merged`: stderr into stdout, to read step lines (stdout) and messages (stderr) in order;
    `env`: variables to set (None removes one)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=kiln_env(**(env or {})),
    )


def assert_user_error(
    proc: subprocess.CompletedProcess, *needles: str, code: int = 2, lines: int = 1
) -> None:
    """The CLI refused: exit `code`, `lines` lines `kiln: error: ...`, every needle among them."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    got = proc.stderr.strip().splitlines()
    assert len(got) == lines, proc.stderr[-3000:]
    assert all(line.startswith("kiln: error: ") for line in got), proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def config_dict(base: Mapping[str, Any] | None = None, **sections: Mapping) -> dict[str, Any]:
    """A nested config dict: a copy of `base` with each keyword's fields set in that section.
    Its runs compile into the test run's one cache (PROGRAMS) unless it names a
    train.compilation_cache_dir of its own: a test of the cache itself sets one."""
    raw = copy.deepcopy(dict(base or {}))
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    raw.setdefault("train", {}).setdefault("compilation_cache_dir", str(PROGRAMS))
    return raw


def make_config(
    base: Mapping[str, Any] | None = None, *, output_dir: str | Path | None = None, **sections
):
    """A validated Config from `config_dict(base, **sections)`; `output_dir` sets train.output_dir."""
    from kiln.config import config_from_dict

    raw = config_dict(base, **sections)
    if output_dir is not None:
        raw.setdefault("train", {})["output_dir"] = str(output_dir)
    return config_from_dict(raw)


def write_config(
    path: Path, base: Mapping[str, Any] | str | None = None, **sections: Mapping
) -> Path:
    """Write a config file: YAML text as given, or `config_dict(base, **sections)` (JSON is YAML)."""
    text = base if isinstance(base, str) else json.dumps(config_dict(base, **sections), indent=1)
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def compile_cache() -> Path:
    """The test run's JAX compilation cache (PROGRAMS), for a config that names its
    train.compilation_cache_dir: a run reads the programs an earlier run of the same model
    compiled, in any worker or subprocess."""
    return PROGRAMS


def shared(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> Path:
    """A directory that `build(path)` fills once per test run, whichever worker asks first; the
    others wait for it. For a fixture that trains a run several test files read: a test that
    writes copies it first. A build that failed fails every test that asks again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base directory, above the workers' own
    path = root / "shared" / name
    done, failed = path.with_name(f"{name}.done"), path.with_name(f"{name}.failed")
    path.parent.mkdir(exist_ok=True)
    with filelock.FileLock(path.with_name(f"{name}.lock")):
        if failed.exists():
            raise AssertionError(f"the shared fixture {name} failed: {failed.read_text()}")
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            try:
                build(path)
            except BaseException as e:
                failed.write_text(repr(e)[:2000])
                raise
            done.touch()
    return path


# What the tests' tiny tokenizers are trained on.
TOKENIZER_LINES = [
    f"line {i}: the quick brown fox {i * 7} jumps over {i % 5} lazy dogs" for i in range(200)
]


def files(root: Path) -> dict[Path, tuple[int, int] | None]:
    """Every path under `root`, with a file's size and modification time: equal before and
    after a command that must write nothing."""
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
        for p in root.rglob("*")
    }


def equations(jaxpr) -> list:
    """Every equation of `jaxpr` (a core Jaxpr) and of the jaxprs nested in its equations."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(equations(sub))
    return found


def blocked_and_whole(make_run, *args) -> tuple[Any, Any]:
    """Results of a loss-engine call in the `cpu_blocked` schedule with chunks of 2 KiB of
    logits and row blocks of 512 B, and in the `whole` schedule.

    `make_run(schedule)` returns a jitted function; the blocked program must have a loop of its
    own, so the comparison is not of one program twice.
    """
    from kiln.losses import CpuBlocked

    results, loops = [], []
    for schedule in (CpuBlocked(chunk_bytes=1 << 11, block_bytes=1 << 9), "whole"):
        run = make_run(schedule)
        loops.append(run.lower(*args).as_text().count("stablehlo.while"))
        results.append(run(*args))
    assert loops[0] > loops[1]  # the blocks are a loop of their own
    return results[0], results[1]


def train_bpe(path: Path, vocab_size: int, special_tokens: list[str]) -> Path:
    """A tiny byte-level BPE tokenizer, trained on a few lines and saved as `path`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TOKENIZER_LINES, trainer)
    bpe.save(str(path))
    return path


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core and one more (at most 4), so that a core is not left idle
    while a test waits on a subprocess, a lock or a signal. A subset of 106 tests ran faster
    with one worker per core, the whole suite did not (docs/testing.md)."""
    return min(4, (os.cpu_count() or 1) + 1)


def pytest_collection_modifyitems(config, items) -> None:
    """Files with end-to-end (`slow`) tests first, then the others largest first, each file's
    tests together.

    pytest-xdist's `--dist worksteal` hands each worker an equal run of this order and lets a
    worker that has finished take the second half of another's queue: a file mostly stays in
    one process (its module fixtures built once), and the long tests start early.
    """
    files: dict[Path, list] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def key(path: Path) -> tuple[bool, int]:
        tests = files[path]
        return not any(t.get_closest_marker("slow") for t in tests), -len(tests)

    items[:] = [item for path in sorted(files, key=key) for item in files[path]]


def pytest_collection_finish(session) -> None:
    """Python's cyclic garbage collector kept off the objects that live for the whole session,
    and run less often.

    Tracing and lowering allocate millions of short-lived containers; with Python's default
    thresholds, full collections walk every object of JAX, Flax, torch and the test modules
    again and again: 5% of the CPU samples of a subset of the suite (training steps, sharded
    steps, compiles, kill -9 resumes), 1.8% with these settings. Frozen objects are never
    collected (they live until the worker exits anyway); garbage in cycles is still freed, by
    fewer collections. Nothing in kiln or the tests depends on when a cycle is freed.
    """
    gc.freeze()
    gc.set_threshold(100_000, 20, 20)


# fsspec's process-wide memory filesystem: URLs `memory://...` stand in for gs:// or s3://.
MEMORY = fsspec.filesystem("memory")


@pytest.fixture
def mem():
    """A fresh root in `MEMORY`, removed afterwards."""
    root = f"/kiln-test-{uuid.uuid4().hex[:8]}"
    MEMORY.makedirs(root, exist_ok=True)
    yield root
    MEMORY.rm(root, recursive=True)

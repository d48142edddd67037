"""Profiler traces of chosen steps, and the persistent compilation cache across starts."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO, kiln_main, make_config
from kiln.errors import KilnError
from kiln.training.profiling import ProfileWindow, cache_dir, compilation_cache_for


def traces(run_dir):
    """The xplane files of every trace under the run's tensorboard/ directory."""
    return sorted((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))


@pytest.mark.parametrize(
    "steps, needle",
    [
        ([5, 3], "start 5 is after stop 3"),
        ([0, 3], "start 0 is before step 1"),
        ([2, 11], "[2, 11] ends after train.steps=10"),
    ],
)
def test_a_profile_window_outside_the_run_is_refused(tmp_path, steps, needle):
    with pytest.raises(KilnError, match=r"train\.profile_steps") as e:
        make_config(output_dir=tmp_path, train={"steps": 10, "profile_steps": steps})
    assert needle in str(e.value) and "1 <= start <= stop <= train.steps" in str(e.value)


def test_the_window_brackets_its_steps_and_a_resumed_run_traces_the_rest(tmp_path):
    x = jnp.ones((4, 4))
    window = ProfileWindow((2, 3), tmp_path, first_step=1)
    for step in (1, 2, 3, 4):
        window.before(step, x)
        assert window.active == (step in (2, 3))
        x = jax.jit(lambda a: a @ a)(x)
        window.after(step, x)
    assert not window.active
    # Under log_dir itself (the loop passes run_dir / "tensorboard"), with a Perfetto copy.
    trace_dir = tmp_path / "plugins" / "profile"
    assert len(list(trace_dir.glob("*/*.xplane.pb"))) == 1
    assert len(list(trace_dir.glob("*/perfetto_trace.json.gz"))) == 1
    assert ProfileWindow((2, 5), tmp_path, first_step=4).start == 4  # resumed inside it
    late = ProfileWindow((2, 5), tmp_path, first_step=7)  # resumed after it: no trace
    late.before(7, x)
    assert not late.active
    stopped = ProfileWindow((2, 5), tmp_path / "stopped", first_step=1)
    stopped.before(2, x)
    stopped.after(2, jax.jit(lambda a: a + 1)(x))
    stopped.close()  # the loop's `finally` when a run stops inside the window
    assert len(list((tmp_path / "stopped").glob("plugins/profile/*/*.xplane.pb"))) == 1


def test_the_cache_setting_is_the_runs_and_is_restored_afterwards(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    config = make_config(output_dir=tmp_path, train={"compilation_cache_dir": ".jax_cache"})
    assert type(config.train).model_fields["compilation_cache_dir"].default == ".jax_cache"
    assert cache_dir(config) == tmp_path / ".jax_cache"  # the default, under train.output_dir
    with compilation_cache_for(config) as path:
        assert jax.config.jax_compilation_cache_dir == str(path.resolve())
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        jax.jit(lambda a: a * 3 + 1)(jnp.arange(5.0)).block_until_ready()
        assert any(path.iterdir())  # even a sub-second compile is kept
    assert jax.config.jax_compilation_cache_dir == before
    off = make_config(output_dir=tmp_path, train={"compilation_cache_dir": None})
    with compilation_cache_for(off) as path:
        assert path is None and jax.config.jax_compilation_cache_dir is None


FIRST = re.compile(r"kiln: first step after \d+\.\ds \(compile cache: (\d+) hits, (\d+) misses\)")


@pytest.mark.slow
def test_a_second_start_reads_the_cache_and_a_resume_continues_the_trace(tmp_path):
    args = [
        "configs/tiny.yaml", f"train.output_dir={tmp_path}", "data.source=synthetic",
        "data.paths=[]", "model.num_layers=1", "optim.warmup_steps=0", "train.eval_every_steps=0",
        "train.log_every_steps=2", "checkpoint.every_steps=0", "train.eval_tasks=[]",
        "model.d_model=32", "model.d_ff=64", "data.seq_len=16", "train.global_batch_size=8",
        "optim.schedule=constant",  # extended below: a cosine decay may not be stretched on resume
    ]  # fmt: skip
    first = kiln_main("train", *args, "train.steps=4", "train.profile_steps=[3,4]", cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    (hits, misses), = FIRST.findall(first.stderr)  # fmt: skip
    assert int(hits) == 0 and int(misses) > 0, first.stderr[-3000:]
    assert any((tmp_path / ".jax_cache").iterdir())
    run_dir = tmp_path / "tiny"
    assert len(traces(run_dir)) == 1

    # The same run resumed with more steps, inside a longer profile window: the run-time knobs
    # may change on resume, the trace covers steps 5..6, and the step comes from the cache.
    second = kiln_main("train", *args, "train.steps=8", "train.profile_steps=[3,6]", cwd=REPO)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from step 4" in second.stderr
    (hits, misses), = FIRST.findall(second.stderr)  # fmt: skip
    assert int(hits) > 0, second.stderr[-3000:]
    assert len(traces(run_dir)) == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step"] for r in rows if "perf/time_to_first_step_seconds" in r]
    assert timed == [2, 6]  # once per start, with the first row written after it

"""Text generation from a trained model with a key/value cache, on the model's mesh.

One prefill runs the left-padded prompt batch through the model and fills the cache; then
one jitted step per token feeds the whole batch's last tokens, reading and extending the
cache in place (donated). Each row keeps its own positions (0 at its first real token) and
its padding is segment 0, which real tokens never attend to, so rows of different prompt
lengths decode exactly as they would alone. Einsum letters: B batch rows, P prompt slots,
N new tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kiln.config import DEFAULT_AXIS_RULES, SEED_LIMIT, read_run_config
from kiln.data.tokenizers import load_tokenizer
from kiln.errors import KilnError
from kiln.model import LanguageModel, abstract_model
from kiln.parallel.mesh import constrain, device_memory, in_mesh, mesh_axes
from kiln.runs.runmodel import load_run_model
from kiln.util.atomic import write_whole
from kiln.util.files import check_creatable
from kiln.util.humanize import gigabytes, plural

# Prompt slots are rounded up to a multiple of this, so that prompts of similar lengths
# share one compiled prefill and step.
PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at temperature 0, else sampled from the
    temperature-scaled softmax restricted to the `top_k` most likely tokens and to the
    smallest set of them whose probability reaches `top_p` (None: no restriction)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self, vocab_size: int) -> None:
        """KilnError naming the setting out of range."""
        if not 0 <= self.temperature < math.inf:
            raise KilnError(f"--temperature: got {self.temperature}; allowed: a number >= 0")
        if self.top_k is not None and not 1 <= self.top_k <= vocab_size:
            raise KilnError(f"--top-k: got {self.top_k}; allowed: 1..{vocab_size} (the vocab)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise KilnError(f"--top-p: got {self.top_p}; allowed: a number in (0, 1]")


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ids [B] (int32) from float32 logits [B, V]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    x_BV = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None:
        kth_B1 = jax.lax.top_k(x_BV, sampling.top_k)[0][:, -1:]
        x_BV = jnp.where(x_BV < kth_B1, -jnp.inf, x_BV)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_BV = jnp.sort(x_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # A token stays if the mass of the tokens ranked above it is below top_p, so the most
        # likely token always stays; the threshold is the smallest logit kept.
        keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < sampling.top_p
        min_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        x_BV = jnp.where(x_BV < min_B1, -jnp.inf, x_BV)
    return jax.random.categorical(key, x_BV, axis=-1).astype(jnp.int32)


class Generation(NamedTuple):
    """Per prompt: new token ids (ending with EOS if one was sampled), why it ended ("eos",
    "stop" or "length"), and with `return_logits` the float32 logits [n, V] of each token."""

    tokens: list[list[int]]
    finish: list[str]
    logits: list[np.ndarray] | None


class _State(NamedTuple):
    """What one decode step reads and writes (donated): the cache, each row's last token and
    its position, whether the row has sampled EOS, the tokens [B,N] (and logits [B,N,V])."""

    cache: Any  # the family's (`LanguageModel.init_cache`)
    last_B: jax.Array
    position_B: jax.Array
    done_B: jax.Array
    tokens_BN: jax.Array
    logits_BNV: jax.Array | None
    step: jax.Array


def _constrain_state(model: LanguageModel, state: _State) -> _State:
    """Pin every row-indexed field to the batch split, so each step keeps one sharding; the
    cache as its family lays it out."""
    logits = state.logits_BNV
    return state._replace(
        cache=model.constrain_cache(state.cache),
        last_B=constrain(state.last_B, ("batch",)),
        position_B=constrain(state.position_B, ("batch",)),
        done_B=constrain(state.done_B, ("batch",)),
        tokens_BN=constrain(state.tokens_BN, ("batch", None)),
        logits_BNV=None if logits is None else constrain(logits, ("batch", None, None)),
    )


@dataclasses.dataclass(frozen=True)
class _Settings:
    sampling: Sampling
    max_new_tokens: int
    eos_id: int  # -1: none
    return_logits: bool


def _pick(model, hidden_BD, key, state: _State, settings: _Settings) -> _State:
    """Sample token `state.step` of every row from the hidden state of its last token."""
    logits_BV = model.logits(hidden_BD)
    token_B = sample(logits_BV, jax.random.fold_in(key, state.step), settings.sampling)
    # A finished row keeps emitting EOS (ignored), so the batch steps on together.
    token_B = jnp.where(state.done_B, max(settings.eos_id, 0), token_B)
    at = (0, state.step)
    tokens_BN = jax.lax.dynamic_update_slice(state.tokens_BN, token_B[:, None], at)
    logits_BNV = state.logits_BNV
    if logits_BNV is not None:
        logits_BNV = jax.lax.dynamic_update_slice(logits_BNV, logits_BV[:, None], (*at, 0))
    return state._replace(
        last_B=token_B,
        done_B=state.done_B | (token_B == settings.eos_id),
        tokens_BN=tokens_BN,
        logits_BNV=logits_BNV,
        step=state.step + 1,
    )


def _prefill(graphdef, settings: _Settings, params, inputs_BP, positions_BP, segment_ids_BP, key):
    """The prompts through the model into a fresh cache, and the first new token of each row."""
    model = nnx.merge(graphdef, params)
    b, p = inputs_BP.shape
    n, v = settings.max_new_tokens, model.cfg.vocab_size
    # The last sampled token is never fed back, so n - 1 slots hold the new tokens.
    cache = model.init_cache(b, p + n - 1)
    hidden_BPD, cache = model.extend(inputs_BP, positions_BP, segment_ids_BP, cache, fresh=True)
    state = _State(
        cache=cache,
        last_B=inputs_BP[:, -1],
        position_B=positions_BP[:, -1],
        done_B=segment_ids_BP[:, -1] == 0,  # rows that only pad the batch
        tokens_BN=jnp.zeros((b, n), jnp.int32),
        logits_BNV=jnp.zeros((b, n, v), jnp.float32) if settings.return_logits else None,
        step=jnp.zeros((), jnp.int32),
    )
    return _constrain_state(model, _pick(model, hidden_BPD[:, -1], key, state, settings))


def _step(graphdef, settings: _Settings, params, state: _State, key):
    """One new token for every row: the last ones through the model over the cache."""
    model = nnx.merge(graphdef, params)
    position_B = state.position_B + 1
    ones_B1 = jnp.ones_like(state.last_B)[:, None]
    hidden_B1D, cache = model.extend(
        state.last_B[:, None], position_B[:, None], ones_B1, state.cache
    )
    state = state._replace(cache=cache, position_B=position_B)
    state = _constrain_state(model, _pick(model, hidden_B1D[:, 0], key, state, settings))
    return state, jnp.all(state.done_B)


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, settings: _Settings, mesh: Mesh | None, rules: tuple):
    """The jitted prefill and step of one model, settings and mesh (compiled per batch shape)."""
    prefill = jax.jit(functools.partial(_prefill, graphdef, settings))
    step = jax.jit(functools.partial(_step, graphdef, settings), donate_argnums=(1,))
    return in_mesh(prefill, mesh, rules), in_mesh(step, mesh, rules)


def decode_rules(rules: Mapping[str, Sequence[str]]) -> tuple:
    """The config's rules with activations whole along length: a decode step has one position."""
    rules = {**dict(rules), "length": (), "act_length": ()}
    return tuple((name, tuple(axes)) for name, axes in rules.items())


def _batch_multiple(mesh: Mesh | None, rules: tuple) -> int:
    """How many pieces the batch is cut into on `mesh` (rows are padded to a multiple)."""
    if mesh is None:
        return 1
    axes = mesh_axes(("batch",), rules, dict(mesh.shape))[0]
    return math.prod(mesh.shape[a] for a in axes)


def _prompt_slots(longest: int, cfg, max_new_tokens: int) -> int:
    """Positions of the left-padded prompts when the longest has `longest` tokens."""
    return min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, cfg.max_seq_len - max_new_tokens)


def decode_bytes(model: LanguageModel, rows: int, longest: int, max_new_tokens: int) -> int:
    """Bytes on the devices of decoding `rows` prompts of up to `longest` tokens, from shapes
    only (an abstract model allocates nothing): the parameters, the KV cache (`init_cache`,
    prompt and new tokens), the new tokens, and a step's float32 logits with the three
    [rows, vocab] arrays sampling makes of them. A lower bound: activations are left out."""
    cfg = model.cfg
    slots = _prompt_slots(longest, cfg, max_new_tokens) + max_new_tokens - 1
    cache = jax.eval_shape(lambda: model.init_cache(rows, slots))
    arrays = [*jax.tree.leaves(nnx.state(model)), *jax.tree.leaves(cache)]
    held = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
    return held + rows * max_new_tokens * 4 + 4 * rows * cfg.vocab_size * 4


def _check_prompts(prompts: Sequence[Sequence[int]], cfg, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise KilnError(f"--max-new-tokens: got {max_new_tokens}; allowed: an integer >= 1")
    if not prompts:
        raise KilnError("no prompts given; give at least one")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise KilnError(f"prompt {i + 1} is empty; a prompt needs at least one token")
        if len(prompt) + max_new_tokens > cfg.max_seq_len:
            raise KilnError(
                f"prompt {i + 1} has {len(prompt)} tokens, which with --max-new-tokens "
                f"{max_new_tokens} is {len(prompt) + max_new_tokens} positions, beyond "
                f"model.max_seq_len={cfg.max_seq_len}; shorten the prompt or generate fewer tokens"
            )
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise KilnError(
                f"prompt {i + 1} has token id {bad[0]}; allowed: 0..{cfg.vocab_size - 1} "
                "(model.vocab_size)"
            )


def generate(
    model: LanguageModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_id: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    mesh: Mesh | None = None,
    rules: Mapping[str, Sequence[str]] | None = None,
    return_logits: bool = False,
    check_every: int = 8,
) -> Generation:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens, all in one batch.

    A row ends at `eos_id` or when `stop(its new tokens)` is true (checked on the host every
    `check_every` steps); decoding ends when every row has. `mesh`/`rules`: where the
    model's parameters live (None: one device); the batch is split like a training batch
    and the cache's heads like the keys'.
    """
    cfg = model.cfg
    _check_prompts(prompts, cfg, max_new_tokens)
    sampling.check(cfg.vocab_size)
    rules_t = decode_rules(rules if rules is not None else DEFAULT_AXIS_RULES)
    settings = _Settings(sampling, max_new_tokens, -1 if eos_id is None else eos_id, return_logits)
    graphdef, params = nnx.split(model)
    prefill, step = _compiled(graphdef, settings, mesh, rules_t)

    rows = len(prompts)
    b = -(-rows // _batch_multiple(mesh, rules_t)) * _batch_multiple(mesh, rules_t)
    p = _prompt_slots(max(len(p) for p in prompts), cfg, max_new_tokens)
    inputs_BP = np.zeros((b, p), np.int32)
    positions_BP = np.zeros((b, p), np.int32)
    segment_ids_BP = np.zeros((b, p), np.int32)
    for r, prompt in enumerate(prompts):  # left padding: every row's last token is at p - 1
        inputs_BP[r, p - len(prompt) :] = prompt
        positions_BP[r, p - len(prompt) :] = np.arange(len(prompt))
        segment_ids_BP[r, p - len(prompt) :] = 1

    key = jax.random.key(seed)
    state = prefill(params, inputs_BP, positions_BP, segment_ids_BP, key)
    stopped = np.zeros(rows, bool)  # rows at EOS or `stop`, as of the last host check
    pending = None  # all-done of the step before, read after the next step is dispatched
    steps = 1
    while steps < max_new_tokens:
        if stop is not None and steps % check_every == 0:
            tokens_BN = np.asarray(state.tokens_BN)[:rows, :steps]
            so_far = [_until_eos(t, settings.eos_id) for t in tokens_BN]
            stopped |= [r[-1] == eos_id or stop(r) for r in so_far]
        state, all_done = step(params, state, key)
        steps += 1
        if pending is not None and (bool(pending) or stopped.all()):
            break
        pending = all_done
    tokens_BN = np.asarray(state.tokens_BN)[:rows, :steps]
    logits_BNV = np.asarray(state.logits_BNV)[:rows] if return_logits else None
    out, finish = [], []
    for r in range(rows):
        row = _until_eos(tokens_BN[r], settings.eos_id)
        out.append(row)
        at_eos = eos_id is not None and row[-1] == eos_id
        finish.append("eos" if at_eos else "stop" if stop is not None and stop(row) else "length")
    logits = None if logits_BNV is None else [logits_BNV[r, : len(t)] for r, t in enumerate(out)]
    return Generation(out, finish, logits)


def _until_eos(tokens_N: np.ndarray, eos_id: int) -> list[int]:
    """The tokens up to and including the first EOS."""
    hits = np.flatnonzero(tokens_N == eos_id)
    return tokens_N[: hits[0] + 1 if len(hits) else len(tokens_N)].tolist()


# ---------------------------------------------------------------------------------------------
# The `kiln generate` command


def read_prompts(path: str | Path) -> list[str]:
    """The "prompt" strings of a JSONL file (blank lines skipped); KilnError naming file:line."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"--prompts: cannot read {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise KilnError(f"{path}:{number}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise KilnError(
                f'{path}:{number}: expected an object with a string "prompt", e.g. '
                '{"prompt": "def main("}'
            )
        prompts.append(record["prompt"])
    if not prompts:
        raise KilnError(f"--prompts: {path} holds no prompt")
    return prompts


def check_seed(seed: int) -> None:
    """KilnError unless `seed` is one of the seeds JAX's keys tell apart (as `train.seed`)."""
    if not 0 <= seed < SEED_LIMIT:
        raise KilnError(f"--seed: got {seed}; allowed: an integer 0 <= seed < 2^32 ({SEED_LIMIT})")


def _check_memory(config, prompts: int, samples: int, longest: int, max_new_tokens: int) -> None:
    """KilnError when the decode batch cannot fit in the local devices' memory (`decode_bytes`)."""
    memory = device_memory(jax.devices())
    if memory is None:
        return
    rows = prompts * samples
    needed = decode_bytes(abstract_model(config.model), rows, longest, max_new_tokens)
    if needed > memory[0]:
        raise KilnError(
            f"--num-samples: {plural(prompts, 'prompt')} x {plural(samples, 'sample')} x (up to "
            f"{longest} prompt + {max_new_tokens} new tokens) need at least "
            f"{gigabytes(needed)} (parameters, KV cache, logits), more than the "
            f"{gigabytes(memory[0])} of {memory[1]}; allowed: fewer samples, prompts or "
            "--max-new-tokens"
        )


def run_generate(
    run_dir: str | Path,
    texts: Sequence[str],
    *,
    step: int | None,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    num_samples: int,
    stop: str | None,
    out: str | Path | None,
) -> str:
    """`kiln generate`: continuations of `texts` by a run's model; the text to print."""
    context = "kiln generate"
    if not Path(run_dir).expanduser().is_dir():
        raise KilnError(f"{context}: run directory not found: {run_dir}")
    path = None if out is None else Path(out).expanduser()
    if path is not None:  # refused before the model is loaded, not after it has generated
        if path.exists():
            raise KilnError(f"--out: {out} already exists; choose a new file")
        check_creatable(path.parent, "--out")
    config = read_run_config(Path(run_dir).expanduser(), context)
    tokenizer = load_tokenizer(config.data.tokenizer)
    check_seed(seed)
    # Training documents follow an EOS (it starts every packed document), so a prompt does too.
    encoded = [[tokenizer.eos_id, *tokenizer.encode(t)] for t in texts]
    _check_prompts(encoded, config.model, max_new_tokens)  # before the parameters are read
    sampling.check(config.model.vocab_size)
    _check_memory(config, len(encoded), num_samples, max(map(len, encoded)), max_new_tokens)
    prompts = [prompt for prompt in encoded for _ in range(num_samples)]
    run = load_run_model(run_dir, step, context=context, config=config)

    def stopped(tokens: list[int]) -> bool:
        return stop in tokenizer.decode(tokens)

    print(
        f"kiln: generating {plural(len(prompts), 'completion')} of up to {max_new_tokens} tokens "
        f"with {run_dir} step {run.step}…",
        file=sys.stderr,
        flush=True,
    )

    result = generate(
        run.model,
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        eos_id=tokenizer.eos_id,
        stop=stopped if stop else None,
        mesh=run.mesh,
        rules=run.config.mesh.rules,
    )
    records = []
    for i, (tokens, finish) in enumerate(zip(result.tokens, result.finish)):
        text = tokenizer.decode(tokens[:-1] if finish == "eos" else tokens)
        if stop and stop in text:
            text = text[: text.index(stop)]
        prompt = texts[i // num_samples]
        # Samples count from 1, as prompts do, in the file and in the printed headers alike.
        records.append(
            {"prompt": prompt, "sample": i % num_samples + 1, "completion": text}
            | {"tokens": tokens, "finish": finish, "step": run.step}
        )
    if path is not None:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, lines)
        return f"wrote {len(records)} completions of {run_dir} step {run.step} to {out}"
    if len(records) == 1:
        return records[0]["prompt"] + records[0]["completion"]
    return "\n\n".join(
        f"=== prompt {i // num_samples + 1}, sample {r['sample']} ({r['finish']}) ===\n"
        + r["prompt"]
        + r["completion"]
        for i, r in enumerate(records)
    )

"""Synthetic token streams: uniform noise, and a fixed random Markov chain of known entropy."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

# Each state of the Markov chain moves to this many successors (one of them state+1, which
# makes the chain irreducible) with Dirichlet(1) probabilities: ~1.7 nats per token.
MARKOV_SUCCESSORS = 8


class MarkovChain(NamedTuple):
    """A sparse chain over V states with K successors each; its arrays are read-only."""

    successors: np.ndarray  # [V, K] int64, ascending in each row
    cum_probs: np.ndarray  # [V, K] float64, cumulative transition probabilities; last = 1
    stationary: np.ndarray  # [V] float64
    entropy_rate: float  # nats per token


@functools.lru_cache(maxsize=4)
def markov_chain(vocab_size: int, seed: int) -> MarkovChain:
    """The chain of (vocab_size, seed), in O(V K) memory and time (any vocabulary size).

    entropy rate H = -sum_i pi_i sum_j P_ij log P_ij, with pi the stationary distribution
    (pi P = pi). Sequences start in pi, so every target token has conditional entropy H and
    H is the lowest expected loss any model can reach on this source.
    """
    rng = np.random.default_rng([seed, 0x4D41524B])
    v = vocab_size
    k = min(MARKOV_SUCCESSORS, v)
    successors = np.empty((v, k), np.int64)
    probs = np.empty((v, k))
    for i in range(v):
        nxt = (i + 1) % v
        # k - 1 other states, drawn as from the V - 1 states without `nxt`.
        others = rng.choice(v - 1, size=k - 1, replace=False)
        succ = np.concatenate([[nxt], others + (others >= nxt)])
        order = np.argsort(succ)
        successors[i], probs[i] = succ[order], rng.dirichlet(np.ones(k))[order]
    pi = np.full(v, 1.0 / v)
    for _ in range(10_000):
        nxt_pi = np.bincount(successors.ravel(), (pi[:, None] * probs).ravel(), minlength=v)
        if np.abs(nxt_pi - pi).sum() < 1e-13:
            break
        pi = nxt_pi
    pi = nxt_pi / nxt_pi.sum()
    entropy = float(-(pi * (probs * np.log(probs)).sum(1)).sum())
    cum = np.cumsum(probs, axis=1)
    cum[:, -1] = 1.0  # rounding must never let u fall past the last successor
    for array in (successors, cum, pi):
        array.setflags(write=False)  # shared by every caller through the cache
    return MarkovChain(successors, cum, pi, entropy)


def uniform_windows(
    ids: np.ndarray, length: int, vocab_size: int, seed: int, stream: int
) -> np.ndarray:
    """[len(ids), length] uniform random tokens; row r depends only on (seed, stream, ids[r])."""
    out = np.empty((len(ids), length), np.int32)
    for r, i in enumerate(ids):
        out[r] = np.random.default_rng([seed, stream, int(i)]).integers(0, vocab_size, length)
    return out


def markov_windows(
    ids: np.ndarray, length: int, vocab_size: int, seed: int, stream: int
) -> np.ndarray:
    """[len(ids), length] samples of the chain, each started in its stationary distribution;
    row r depends only on (seed, stream, ids[r])."""
    chain = markov_chain(vocab_size, seed)
    start_cum = np.cumsum(chain.stationary)
    start_cum[-1] = 1.0
    u = np.stack([np.random.default_rng([seed, stream, int(i)]).random(length) for i in ids])
    out = np.empty((len(ids), length), np.int32)
    out[:, 0] = np.searchsorted(start_cum, u[:, 0], side="right")
    for t in range(1, length):
        prev = out[:, t - 1]
        # The first successor whose cumulative probability exceeds u.
        pick = (chain.cum_probs[prev] <= u[:, t, None]).sum(1)
        out[:, t] = chain.successors[prev, pick]
    return out

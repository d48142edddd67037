"""A trained run's model for inference (`kiln generate`, `kiln eval`, scripts): one checkpoint's
parameters on the mesh of the run's config, never its optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
from flax import nnx, struct
from jax.sharding import Mesh

from kiln.config import Config, read_run_config
from kiln.model import LanguageModel, build_model
from kiln.parallel.mesh import make_mesh, sharded_abstract, use_mesh


class ModelState(struct.PyTreeNode):
    """A model's parameters (and other variables) without optimizer state."""

    params: nnx.State
    rest: nnx.State
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.rest)


class RunModel(NamedTuple):
    """A trained run's model state at one checkpoint step, on the mesh of its config."""

    config: Config
    mesh: Mesh
    state: ModelState
    step: int

    @property
    def model(self) -> LanguageModel:
        return self.state.model()


def load_run_model(
    run_dir: str | Path, step: int | None = None, *, context: str, config: Config | None = None
) -> RunModel:
    """The model of a run directory at checkpoint `step` (None = the newest intact one).

    The mesh is the run config's (`mesh.*` over this process's devices; `config` is the run's
    config.yaml, read when not given). Parameters are read straight into their shardings on
    it; errors are KilnErrors starting with `context` (e.g. "kiln generate").
    """
    from kiln.runs.restore import restore_run_params  # orbax: imported when a run is loaded

    run_dir = Path(run_dir).expanduser()
    config = config if config is not None else read_run_config(run_dir, context)
    mesh = make_mesh(config)

    def build():
        return build_model(config.model, rngs=nnx.Rngs(0))

    graphdef, abstract = sharded_abstract(build, mesh, config.mesh.rules)
    abstract_params, rest = nnx.split_state(abstract, nnx.Param, ...)
    params, step = restore_run_params(run_dir, abstract_params, step, context=context)
    if jax.tree.leaves(rest):
        # Variables that are not parameters (none in today's families) are created as at
        # init; XLA drops the parameter initialisers, which nothing returns.
        shardings = jax.tree.map(lambda x: x.sharding, rest)
        with use_mesh(mesh, config.mesh.rules):
            rest = jax.jit(
                lambda: nnx.split_state(nnx.state(build()), nnx.Param, ...)[1],
                out_shardings=shardings,
            )()
    return RunModel(config, mesh, ModelState(params=params, rest=rest, graphdef=graphdef), step)

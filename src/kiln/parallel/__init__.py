"""Devices: the mesh, shardings from logical axis names, and multi-process start-up.

Modules: `mesh` (`make_mesh`, `logical_spec` / `logical_sharding` over the one resolver in
`kiln.config.axes`, `use_mesh` / `constrain` for model code, sharded init and abstract states)
and `distributed` (`jax.distributed.initialize` from the `distributed` section).

May import: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`.

Public names: `mesh.make_mesh`, `mesh.logical_spec`, `mesh.logical_sharding`,
`mesh.batch_sharding`, `mesh.use_mesh`, `mesh.in_mesh`, `mesh.constrain`, `mesh.sharded_init`,
`mesh.sharded_abstract`, `mesh.state_shardings`, `distributed.initialize`.
"""

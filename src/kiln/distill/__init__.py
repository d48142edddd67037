"""Distillation: a teacher trains a student through the trainer's objective seam.

Modules: `teacher` (a frozen teacher from a run directory), `online` (`DistillObjective`: hard,
soft and feature losses with their schedules and balancing), `store`, `writer`, `reader` and
`checks` (`kiln teacher-logits`: the teacher's top-k logits written once and read back in the
batches), `offline` (distillation from such a store) and `run` (`kiln distill`, online or
offline).

May import: every layer below: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`,
`kiln.parallel`, `kiln.losses`, `kiln.model`, `kiln.runs`, `kiln.training`.

Public names: `run.run`, `online.DistillObjective`, `online.init_student`,
`teacher.load_teacher`, `teacher.Teacher`, `writer.run` (`kiln teacher-logits`).
"""

"""Offline distillation targets: `kiln teacher-logits` writes a teacher's top-k logits; `kiln distill` reads them."""

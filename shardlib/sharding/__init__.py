"""Where every tensor lives: the mesh, logical-axis rules, strategies as rule tables, and the
layout they produce for one model (storage, optimizer-state and compute placement)."""

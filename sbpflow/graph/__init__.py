"""Graph mode: ``sf.nn.Graph`` traces a training step once and replays it on the actor runtime.

`trace` records ``build`` into a `Tape` (ops with their signatures fixed, boxing steps,
backward); `lower` cuts it into pipeline stages where the placement changes; `plan` turns the
stages into actors (forward, backward, send / recv, update) whose register budgets are the
pipeline schedule; `Compiled` runs them per call. See docs/runtime.md, 'Graph mode'.
"""

from .nn_graph import Graph, GraphConfig

__all__ = ["Graph", "GraphConfig"]

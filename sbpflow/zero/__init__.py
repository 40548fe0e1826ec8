"""ZeRO as layouts (docs/zero.md). Along a parameter's data-parallel dims (where it is ``B``)
stage 1 keeps its optimizer state split, stage 2 its gradient too, stage 3 the parameter itself:
`layout` gives the split *stored* layout and each shard's place in the compute-layout shard,
and the coalesced reduce-scatters and all-gathers. Stage 1 only sets the update layout: the
optimizer reduce-scatters the gradient (`shard_sync` starts it during backward), updates the
shard and all-gathers it back in the background (`pending`). Stages 2 and 3 store the
parameter split and `units` box it to its compute layout around each *unit*'s forward (the
model and each child of a numbered container): `gather`'s one all-gather whose backward is one
reduce-scatter, the next unit's gather prefetched; stage 3 frees the gathered copy after the
forward and gathers it again in backward (`release`, which also counts it in
`sf.memory.track`). A graph records a unit's call as tasks (`unit_tasks`); the collectives run
on a worker thread (`worker`). Layer: above `gradsync` (whose buckets `shard_sync` shares) and
`memory`, below `nn` and `optim`, whose step uses it; the user face is `sf.parallel.zero`.
"""

from . import release  # noqa: F401  (every unit's default on_gather: stage 3's release)

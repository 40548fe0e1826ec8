"""Cyclic Data Parallelism (../shared/CDP.md): the staggered schedule as data (`cycles`), the
update rules (`rules`), the settings (`roles`), the tasks of a run (`program`), run on the
actor runtime by `CyclicDataParallel`; `closed_form` is the reference rule. See docs/cdp.md."""

from . import cycles, program, roles, rules
from .closed_form import closed_form
from .roles import MODES, ranks_needed
from .rules import RULES
from .stage_split import split_sequential
from .trainer import CyclicDataParallel

__all__ = ["CyclicDataParallel", "closed_form", "cycles", "rules", "roles", "program", "MODES",
           "RULES", "ranks_needed", "split_sequential"]

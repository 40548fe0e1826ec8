"""Communication: the Communicator protocol, its backends, byte counters, launch and init."""

from .base import (CommStats, Communicator, KindStats, collective_stream, reduce_tensors,
                   set_collective_stream)
from .threads import ThreadCommunicator, ThreadWorld
from .current import (at_rank_exit, current, is_initialized, rank, rank_local, reset_stats,
                      set_current, stats, world_size)
from .world import init, launch

__all__ = ["Communicator", "CommStats", "KindStats", "ThreadWorld", "ThreadCommunicator",
           "current", "init", "is_initialized", "launch", "rank", "rank_local", "reset_stats",
           "set_current", "stats", "world_size", "reduce_tensors", "collective_stream",
           "set_collective_stream", "at_rank_exit"]

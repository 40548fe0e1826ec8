"""The cost model: a cluster of nodes × devices with alpha-beta links, the time of collectives,
of boxing steps and plans on it, and calibration of alpha and beta from measured collectives.

    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    c.collective_time("all_reduce", 2**30, ranks=range(16))   # seconds (inter-node: spans nodes)
    p = sf.boxing.plan((1024, 1024), torch.float32, src=(pl, sf.P), dst=(pl, sf.B))
    sf.cost.plan_time(p, c)
    cluster, report = sf.cost.calibrate()       # on every rank of a launched world
"""

from .calibrate import CalibrationReport, Sample, calibrate, calibrate_command, fit_alpha_beta
from .cluster import PRESETS, Cluster, CostError, Link
from .collectives import (KINDS, collective_time, latency_messages, plan_time, step_groups,
                          step_time, volume)

__all__ = ["Cluster", "Link", "CostError", "PRESETS", "KINDS", "collective_time",
           "latency_messages", "volume", "step_time", "plan_time", "step_groups", "calibrate",
           "fit_alpha_beta", "CalibrationReport", "Sample", "calibrate_command"]

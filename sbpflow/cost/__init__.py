"""The cost model: a cluster of nodes × devices with alpha-beta links (optionally per-kind
``(alpha, beta, overhead)`` fits, a strided-copy cost and a per-step software cost), the time of
collectives, of boxing steps and plans on it, and calibration of all of these from measurements.

    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    c.collective_time("all_reduce", 2**30, ranks=range(16))   # seconds (inter-node: spans nodes)
    p = sf.boxing.plan((1024, 1024), torch.float32, src=(pl, sf.P), dst=(pl, sf.B))
    sf.cost.plan_time(p, c)
    cluster, report = sf.cost.calibrate()       # on every rank of a launched world
"""

from .calibrate import calibrate, calibrate_command
from .cluster import DEFAULT_FLOPS_PER_DEVICE, PRESETS, Cluster
from .collectives import plan_time, step_groups, step_time
from .fit import fit_alpha_beta, fit_collective, fit_copy
from .formulas import (ALGORITHMS, KINDS, CollectiveFit, CostError, Link, collective_time,
                       latency_messages, volume)
from .report import CalibrationReport, Sample

__all__ = ["Cluster", "Link", "CollectiveFit", "CostError", "PRESETS", "KINDS", "ALGORITHMS",
           "DEFAULT_FLOPS_PER_DEVICE",
           "fit_collective", "fit_copy", "collective_time",
           "latency_messages", "volume", "step_time", "plan_time", "step_groups", "calibrate",
           "fit_alpha_beta", "CalibrationReport", "Sample", "calibrate_command"]

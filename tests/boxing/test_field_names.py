"""Names that mean one thing (issue 13): a plan's ``src`` / ``dst`` are layouts, ``(placement,
nd-sbp)`` pairs as `sf.boxing.plan` takes them; a step's nd-sbps are ``src_sbp`` / ``dst_sbp``,
beside its ``src_placement`` / ``dst_placement``."""

import torch

import sbpflow as sf


def test_plan_layouts_and_step_sbps():
    mesh = sf.placement("cpu", [[0, 1], [2, 3]])
    line = sf.placement("cpu", [4, 5])
    plan = sf.boxing.plan((8, 6), torch.float32, src=(mesh, (sf.P, sf.S(1))),
                          dst=(line, sf.S(0)))
    assert plan.src == (mesh, (sf.P, sf.S(1))) and plan.dst == (line, (sf.S(0),))
    kinds = [s.kind for s in plan.steps]
    assert kinds[-1] == "transfer" and len(kinds) == 2, plan  # reduce on the mesh, then send
    reduce, send = plan.steps
    assert (reduce.src_placement, reduce.src_sbp) == plan.src
    assert reduce.dst_placement == mesh and reduce.dst_sbp == send.src_sbp
    assert (send.dst_placement, send.dst_sbp) == plan.dst
    for step in plan.steps:
        assert not hasattr(step, "src") and not hasattr(step, "dst")
    # the dual step (backward) swaps and dualises the sbps: dual(P) = B, dual(S) = S
    back = sf.boxing.dual_step(send)
    assert (back.src_placement, back.src_sbp) == (line, (sf.S(0),))
    assert back.dst_placement == mesh
    assert back.dst_sbp == tuple(sf.B if isinstance(s, sf.sbp.Partial) else s
                                 for s in send.src_sbp)

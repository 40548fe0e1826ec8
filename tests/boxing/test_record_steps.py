"""`sf.boxing.record_steps` lists the boxing steps a rank runs, forward then the dual backward,
with the bytes of the plan the boxing follows."""

import torch

import sbpflow as sf


def test_record_steps_lists_forward_steps_and_their_duals():
    full = torch.arange(24, dtype=torch.float64).reshape(6, 4)

    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(full, pl, sf.S(0)).requires_grad_()
        with sf.boxing.record_steps() as steps:
            y = x.to_global(sbp=sf.B)
            y.sum().backward()
        outside = x.to_global(sbp=sf.B)   # after the block: not recorded
        plan = sf.boxing.plan((6, 4), torch.float64, (pl, (sf.S(0),)), (pl, (sf.B,)))
        return ([(phase, step.kind, step.nbytes) for phase, step in steps], plan.nbytes,
                outside.full_tensor())

    for got, planned, value in sf.launch(body, world_size=2):
        assert [(p, k) for p, k, _ in got] == [("forward", "all_gather"),
                                                ("backward", "reduce_scatter")]
        assert got[0][2] == planned == got[1][2] > 0
        assert torch.equal(value, full)

"""A tour of layouts and boxing. Run it on 4 ranks with any launcher:

    sbpflow run -n 4 examples/boxing_tour.py                  # threads: one thread a rank
    sbpflow run -n 4 --backend torch examples/boxing_tour.py  # gloo processes
    torchrun --nproc-per-node 4 examples/boxing_tour.py       # the same, under torchrun
"""

import torch

import sbpflow as sf

sf.init()  # joins torchrun's world; a no-op inside `sbpflow run`
if sf.world_size() < 4:
    raise SystemExit("run me on 4 ranks: sbpflow run -n 4 examples/boxing_tour.py")

mesh = sf.placement("cpu", ranks=[[0, 1], [2, 3]])   # 2 groups x 2 ranks
x = sf.randn(6, 10, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=0)

# rows split across groups, columns inside a group -> rows inside a group, replicated across
y = x.to_global(sbp=(sf.B, sf.S(0)))
# move to two other devices, split by columns (what a pipeline stage boundary does)
z = y.to_global(placement=sf.placement("cpu", ranks=[2, 3]), sbp=sf.S(1))
assert torch.equal(z.full_tensor(), x.full_tensor())

# gradients flow back through every boxing in the dual layout: the gradient of a (B, B) tensor
# is (P, P) (here the logical ones, held by rank 0), and the all-gather's dual is a reduce-scatter
w = sf.randn(6, 10, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=1, requires_grad=True)
w.to_global(sbp=(sf.B, sf.B)).backward(sf.ones(6, 10, placement=mesh, sbp=(sf.P, sf.P)))
assert w.grad.sbp == (sf.S(0), sf.S(1))
assert torch.equal(w.grad.full_tensor(), torch.ones(6, 10))

if sf.rank() == 0:
    print(x)
    print(sf.boxing.plan(x.shape, x.dtype, src=(x.placement, x.sbp), dst=(mesh, (sf.B, sf.S(0)))))
    print(sf.boxing.plan(x.shape, x.dtype, src=(mesh, (sf.B, sf.S(0))),
                         dst=(sf.placement("cpu", [2, 3]), (sf.S(1),))))
    print("rank 0 communication:", sf.comm.stats())

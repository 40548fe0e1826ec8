"""VersionStore.unused (no read left, no micro-batch holding the version) and StageOwner's
update in place of a copy: the same next version, written into the unused one."""

import torch

import sbpflow as sf
from sbpflow.parallel.cdp.version_store import StageOwner, VersionStore


def test_a_version_is_unused_after_its_last_read_and_its_last_hold():
    store = VersionStore(1, lambda stage, version: 2)
    store.put(0, 3, [torch.ones(2)])
    store.take(0, 3)
    assert not store.unused(0, 3)          # a read is left
    store.hold(0, 3)
    store.take(0, 3)
    assert not store.unused(0, 3)          # read out, but a micro-batch holds it
    store.drop(0, 3)
    assert store.unused(0, 3)
    assert store.unused(0, 4)              # never put here: nothing reads or holds it


def test_update_in_place_gives_the_copy_update_s_version_in_the_unused_tensors():
    g = torch.Generator().manual_seed(0)
    first = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in first] for _ in range(3)]

    def body():
        pl = sf.placement("cpu", [0])
        out = []
        for in_place in (False, True):
            owner = StageOwner(first, pl, 2, lambda ps: sf.optim.SGD(ps, lr=0.1, momentum=0.9),
                               2)
            latest = [t.clone() for t in first]
            for step in grads:
                before = [t.clone() for t in latest]
                new = owner.step(latest, [gr.clone() for gr in step], in_place=in_place)
                shared = [n.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                          for n, t in zip(new, latest)]
                assert all(shared) if in_place else not any(shared)
                if not in_place:  # the copy's update leaves the version read as it was
                    assert all(torch.equal(t, b) for t, b in zip(latest, before))
                latest = [t.detach() for t in new]
            out.append(latest)
        return out

    copied, in_place = sf.launch(body, world_size=1)[0]
    assert all(torch.equal(a, b) for a, b in zip(copied, in_place))

"""On the torch backend, the queue thread that waits for other ranks' messages reads them off
the sockets itself (messaging._Leading, receiver.Receiver.lead): one thread wake-up a
message instead of the receiver thread's and then the queue thread's; the values are the
same, whether the waiting thread spins first (the default) or blocks at once
(SBPFLOW_SPIN_US=0) (docs/runtime.md 'Message channels')."""

import pytest

from runtime_route_fns import who_reads_fn
from sbpflow.comm import launch

N = 200


@pytest.mark.gloo
@pytest.mark.parametrize("spin_us", [None, "0"])
def test_the_waiting_queue_thread_reads_its_messages_itself(monkeypatch, spin_us):
    if spin_us is not None:
        monkeypatch.setenv("SBPFLOW_SPIN_US", spin_us)
    res = launch(who_reads_fn, 2, backend="torch", args=(N,))
    assert res[1]["values"] == [[10 * i + 1 for i in range(N)]] * 2
    assert res[0]["values"] == [None, None]
    for rank, queue in ((0, "data"), (1, "compute")):
        readers = res[rank]["readers"]
        assert len(readers) >= 2 * N  # every req (rank 1) or ack (rank 0), and the starts
        mine = readers.count(f"sbpflow-rank{rank}-{queue}")
        # (the receiver thread reads what comes while its queue has not waited for 10 ms:
        # before a run's first wait, on a loaded machine)
        assert mine >= 0.5 * len(readers), (rank, mine, len(readers))

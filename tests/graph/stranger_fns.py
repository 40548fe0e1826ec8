"""A pipelined graph on gloo processes under a stranger's connections (module level: the
processes import it)."""

from __future__ import annotations

import os
import threading

from graph_fns import gpt_pipeline
from transport_probe import payloads, send_as_stranger


def attacked_pipeline(path: str, steps: int) -> dict:
    """A 2-stage GPT pipeline graph trains ``steps`` steps while, on rank 0, a stranger thread
    connects to rank 1's message socket every 0.1 s and sends `payloads`."""
    import sbpflow as sf
    from sbpflow.comm.socket_channels import address_key
    channels = sf.comm.current()._chan()
    done = threading.Event()
    host, port = channels._store.get(address_key(1)).decode().rsplit(":", 1)

    def stranger() -> None:
        while not done.wait(0.1):  # a round every 0.1 s while the graph trains
            for data in payloads(path):
                send_as_stranger(host, int(port), data)

    thread = threading.Thread(target=stranger, daemon=True)
    if sf.rank() == 0:
        thread.start()
    try:
        result = gpt_pipeline([[0], [1]], ["blocks.2"], None, sf.B, 10, 2, "1f1b", steps)
    finally:
        done.set()
    if sf.rank() == 0:
        thread.join(10)
    result["planted"] = os.path.exists(path)
    result["dropped"] = channels._receiver.dropped  # connections refused
    return {k: result[k] for k in ("sd0", "losses", "sd", "planted", "dropped")}

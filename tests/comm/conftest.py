"""Fixtures of the message-channel tests: a local c10d TCPStore the 'ranks' of one process share."""

import pytest
import torch.distributed as dist


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    yield s
    del s

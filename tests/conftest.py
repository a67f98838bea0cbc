"""Fixtures several test files share."""
import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A real gloo world of one rank in this process (a HashStore: nothing listens)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

"""search.fits_budget: whether a search finds a plan under a budget, decided at the first
proof. Held to the search itself at the edge: the smallest budget the search reports
(``InfeasibleBudget.min_budget``) fits, a byte less does not, for stpc's own space and each
baseline's (recomputation ladders included)."""
import pytest
import torch

from stpc import models, trace
from stpc.cost_models import get_cluster
from stpc.planner import InfeasibleBudget, search
from stpc.planner.search import fits_budget

CLUSTER = get_cluster("primepar-v100")
N = 2   # devices (every layout of each space on 2: a quick search)


@pytest.fixture(scope="module")
def tg():
    with torch.device("meta"):
        m = models.build("llama-tiny").to(torch.float16)
    return trace(m, models.example_inputs(models.get_config("llama-tiny"), 8, 64))


@pytest.mark.parametrize("hints", [None, "megatron", "fsdp-tp"])
def test_fits_exactly_where_the_search_finds_a_plan(tg, hints):
    kw = dict(hints=hints, optimizer_layout="mixed-adam")
    with pytest.raises(InfeasibleBudget) as err:
        search(tg, N, CLUSTER, budget_bytes=1.0, dtype="fp16", **kw)
    least = err.value.min_budget   # the smallest budget any point of the space fits
    assert not fits_budget(tg, N, CLUSTER, least - 1, **kw)
    assert fits_budget(tg, N, CLUSTER, least, **kw)
    plan = search(tg, N, CLUSTER, budget_bytes=least, dtype="fp16", **kw)   # the search agrees
    assert plan.peak_memory_bytes <= least
    assert fits_budget(tg, N, CLUSTER, None, **kw) and fits_budget(tg, N, CLUSTER, 1e15, **kw)

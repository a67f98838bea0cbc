"""Shared by the runtime-op tests: the comparison and the P2P-only guard."""
import torch

RTOL = ATOL = 1e-5  # float32 ops against float64 single-device references


def cmp(actual, expected):
    """None if ``actual`` matches the float64 reference, else the mismatch report."""
    try:
        torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=ATOL)
        return None
    except AssertionError as e:
        return str(e)


class P2POnly:
    """Counts P2P sends and makes any collective raise while active (monkeypatching dist)."""

    COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                   "reduce_scatter_tensor", "broadcast", "all_to_all", "barrier"]

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.sends, self.saved = dist, 0, {}

    def __enter__(self):
        d = self.dist
        self.saved["batch_isend_irecv"] = d.batch_isend_irecv

        def counting(ops):
            self.sends += sum(op.op is d.isend for op in ops)
            return self.saved["batch_isend_irecv"](ops)

        d.batch_isend_irecv = counting
        for name in self.COLLECTIVES:
            self.saved[name] = getattr(d, name)

            def forbidden(*a, _name=name, **k):
                raise AssertionError(f"collective {_name} called inside a P2P-only op")

            setattr(d, name, forbidden)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)

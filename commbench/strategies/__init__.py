"""One file per strategy, each with comm_ops(model, par) -> [CommOp]:
ddp (zero 0), zero (1, 2), fsdp (3), tp, pp. plan.py composes them."""

"""commbench: collective-communication microbenchmarks for distributed training."""

__version__ = "0.1.0"

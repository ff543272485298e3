"""The configuration of `commbench run`, validated on construction: a bad value
is a ValueError naming the value and the rule."""
from dataclasses import dataclass, field

from commbench import collectives as coll_mod
from commbench import groups as groups_mod
from commbench.backends import BACKENDS
from commbench.dtypes import parse_dtypes, parse_redops
from commbench.sizes import sweep
from commbench.timing import TimingSettings, check_timeout

IN_PLACE_MODES = {"no": (False,), "yes": (True,), "both": (False, True)}


@dataclass
class RunConfig:
    minbytes: int = 8
    maxbytes: int = 32 << 20
    stepfactor: float | None = 2.0
    stepbytes: int | None = None
    collectives: str = "all"
    dtypes: str = "float32"
    redops: str = "sum"
    backend: str = "torch"
    dist_backend: str | None = None
    device: str = "cpu"
    layouts: str = "world"
    in_place: str = "no"
    check_iters: int = 1
    root: int = 0
    timing: TimingSettings = field(default_factory=TimingSettings)
    timeout_s: float | None = None     # None: each collective's deadline scales with its size (watchdog.py)
    keep_rank_samples: bool = False
    # the timing of a --plan's ZeRO-1 parameter-broadcast burst (the step's
    # whole optimizer-side exchange as one case), where it differs from timing
    burst_timing: TimingSettings | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: choose cpu or cuda")
        if self.dist_backend not in (None, "gloo", "nccl", "mpi"):
            raise ValueError(f"unknown torch process-group backend {self.dist_backend!r}: gloo, nccl or mpi")
        if self.in_place not in IN_PLACE_MODES:
            raise ValueError(f"--in-place {self.in_place!r}: choose no, yes or both")
        self.timing.check()
        if self.burst_timing is not None:
            self.burst_timing.check()
        if self.check_iters < 0:
            raise ValueError(f"-c/--check must be >= 0, got {self.check_iters}")
        if self.root < 0:
            raise ValueError(f"-r/--root must be >= 0, got {self.root}")
        check_timeout(self.timeout_s)
        self.sizes = sweep(self.minbytes, self.maxbytes, self.stepfactor, self.stepbytes)
        self.collective_list = coll_mod.parse(self.collectives)
        self.dtype_list = parse_dtypes(self.dtypes)
        self.redop_list = parse_redops(self.redops)
        self.layout_list = groups_mod.parse_layouts(self.layouts)

    @property
    def rendezvous_timeout_s(self) -> float:
        """Of the rendezvous and of the backend's own operation timeout: --timeout
        when given, else 300 s or twice the largest size's collective deadline."""
        from commbench.watchdog import rendezvous_timeout_s
        return rendezvous_timeout_s(self.timeout_s, max(self.sizes) if self.sizes else 0)

    @property
    def in_place_list(self):
        return IN_PLACE_MODES[self.in_place]

    def settings(self) -> dict:
        """What the results header records of this configuration."""
        t = self.timing
        return {"sizes": self.sizes, "collectives": [c.name for c in self.collective_list],
                "dtypes": self.dtype_list, "redops": self.redop_list, "backend": self.backend,
                "dist_backend": self.dist_backend, "device": self.device, "layouts": self.layout_list,
                "in_place": self.in_place, "check_iters": self.check_iters, "root": self.root, "warmup": t.warmup,
                "iters": t.iters, "max_iters": t.max_iters, "time_budget_s": t.time_budget_s,
                "target_ci": t.target_ci, "ci_of": t.ci_of, "timeout_s": self.timeout_s,
                **({} if self.burst_timing is None else
                   {"burst_time_budget_s": self.burst_timing.time_budget_s,
                    "burst_min_time_s": self.burst_timing.min_time_s})}

    def timing_of(self, collective: str) -> TimingSettings:
        """The timing of one collective's cases: burst_timing for the
        broadcast burst where set, else timing."""
        return self.burst_timing if collective == "broadcast_burst" and self.burst_timing else self.timing

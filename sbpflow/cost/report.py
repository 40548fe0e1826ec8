"""What a calibration measured and fitted: `Sample` (one measured point) and
`CalibrationReport` (every sample, the fits, their residuals; printable, and stored beside the
cluster it produced)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .formulas import CollectiveFit, Link

__all__ = ["Sample", "CalibrationReport"]


@dataclass
class Sample:
    """One measured point: median seconds over repeats of the slowest rank."""

    link: str  # "intra" or "inter"
    kind: str
    p: int
    nbytes: int
    seconds: float
    predicted: float = 0.0

    @property
    def relative_residual(self) -> float:
        """(measured - predicted) / measured."""
        return (self.seconds - self.predicted) / self.seconds


@dataclass
class CalibrationReport:
    """What `calibrate` measured and fitted. ``fits[link] = (alpha, beta)`` for each measured
    link class; ``kind_fits[link][kind]`` the per-kind fits (if any), `CollectiveFit` tuples;
    ``rms[link]`` / ``worst[link]`` the RMS / largest absolute relative residual of the model
    the cluster uses (per-kind where fitted); ``copy_beta`` the strided-copy cost fitted to
    ``copy_samples``."""

    backend: str
    world_size: int
    devices_per_node: int
    repeats: int
    inner: int = 1
    samples: list = field(default_factory=list)
    fits: dict = field(default_factory=dict)
    rms: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    copied: dict = field(default_factory=dict)  # unmeasured link class -> the one it copies
    seconds: float = 0.0  # wall time of the calibration
    kind_fits: dict = field(default_factory=dict)  # link -> kind -> CollectiveFit fields
    copy_samples: list = field(default_factory=list)  # (nbytes, seconds)
    copy_beta: float = 0.0
    step_overhead: float = 0.0  # median seconds of one local boxing step (all ranks at once)

    def to_dict(self) -> dict:
        """The report as plain data, for JSON."""
        return {"backend": self.backend, "world_size": self.world_size,
                "devices_per_node": self.devices_per_node, "repeats": self.repeats,
                "inner": self.inner,
                "fits": {k: {"alpha": a, "beta": b} for k, (a, b) in self.fits.items()},
                "rms_relative_residual": self.rms, "max_relative_residual": self.worst,
                "copied": self.copied, "seconds": self.seconds,
                "kind_fits": {lc: {k: CollectiveFit(*f)._asdict()
                                   for k, f in t.items()} for lc, t in self.kind_fits.items()},
                "copy_samples": [list(c) for c in self.copy_samples],
                "copy_beta": self.copy_beta, "step_overhead": self.step_overhead,
                "samples": [[s.link, s.kind, s.p, s.nbytes, s.seconds, s.predicted]
                            for s in self.samples]}

    def __str__(self) -> str:
        nodes = self.world_size // self.devices_per_node
        lines = [f"calibration on {self.world_size} {self.backend} rank(s) "
                 f"({nodes} node(s) x {self.devices_per_node}), median of {self.repeats} "
                 f"rounds x {self.inner} calls, {self.seconds:.1f} s",
                 f"{'link':<6}{'kind':<16}{'p':>3}{'bytes':>11}{'measured us':>14}"
                 f"{'fit us':>11}{'resid':>8}"]
        for s in self.samples:
            lines.append(f"{s.link:<6}{s.kind:<16}{s.p:>3}{s.nbytes:>11}{s.seconds * 1e6:>14.1f}"
                         f"{s.predicted * 1e6:>11.1f}{s.relative_residual:>+8.0%}")
        for link, (a, b) in self.fits.items():
            lines.append(f"{link}: {Link(a, b)}; relative residuals rms {self.rms[link]:.1%}, "
                         f"max {self.worst[link]:.1%}")
            for kind, f in self.kind_fits.get(link, {}).items():
                lines.append(f"  {kind:<15}{CollectiveFit(*f)}")
        if self.copy_samples:
            pts = ", ".join(f"{n >> 10} KiB {t * 1e6:.0f} us" for n, t in self.copy_samples)
            lines.append(f"strided copy: {self.copy_beta * 1e12:.4g} ps/B ({pts})")
        if self.step_overhead:
            lines.append(f"boxing step overhead: {self.step_overhead * 1e6:.3g} us")
        for link, src in self.copied.items():
            lines.append(f"{link}: not measured (no such link in this world), copied from {src}")
        return "\n".join(lines)

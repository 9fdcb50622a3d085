"""What bench/ knows about one op, in one declaration: :class:`OpSpec`.

Each module of :mod:`flashflow.bench.ops` defines one ``SPEC``; ``flashflow tune``,
``flashflow info`` and the tests loop over :data:`flashflow.bench.ops.SPECS` instead of naming
ops. The pieces a spec is built from (a tune case, an info case, the candidate helpers) live
here so the op modules import down, never from the commands that use them.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

# a candidate's output against the anchor's: relative L2 error at most this, else not timed
TOLERANCE = 1e-2


class NotApplicable(Exception):
    """A candidate that does not exist for this shape (e.g. a split-K field on a prefill shape)."""


@dataclass
class TuneCase:
    """One shape of ``flashflow tune``: the anchor to beat and how to build a candidate."""
    label: str
    shape: dict
    anchor: object     # zero-argument callable, the reference output and the time to beat
    make: object       # overrides -> zero-argument callable (NotApplicable if it does not exist)
    work: float        # FLOP or bytes: work / seconds is the metric
    steps: int         # calls per CUDA graph (0: timed eagerly, do_bench on the call itself)
    shipped: dict      # the shipped config's fields and plan options
    repeat_check: int = 0   # > 0: a candidate must give the same bits this many times over


@dataclass(frozen=True)
class InfoCase:
    """One launch of ``flashflow info``: ``launch(device)`` runs it once on tensors of ``device``."""
    op: str
    label: str
    launch: Optional[Callable[[str], None]]
    columns: dict = field(default_factory=dict)   # config columns shown before the figures


@dataclass(frozen=True)
class TuneOption:
    """An option of ``flashflow tune`` an op declares: ``add_argument(*flags, **kwargs)``."""
    flags: tuple
    kwargs: dict

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class OpSpec:
    """One op as the benchmarks see it.

    ``flashflow info``: ``info_cases(family)`` are the launches that reach every kernel the op
    ships (``family`` None where nothing is compiled); ``info_listing(family)``, where given, the
    rows listed instead when nothing is compiled (the config table as it ships).

    ``flashflow tune``: an op with ``axes`` is tunable. ``tune_shapes(args)`` the shapes from the
    parsed options, ``tune_case(shape, args)`` one :class:`TuneCase`; a candidate replaces fields
    of ``config_classes`` or ``plan_options``; ``unit`` is the metric, ``anchor`` who it beats,
    ``tune_timing`` the :mod:`flashflow.bench.timing` discipline whose rounds time it.
    """
    name: str                               # `flashflow tune NAME`, `flashflow info --op NAME`
    info_title: str                         # heading of its `flashflow info` table
    info_cases: Callable[[Optional[str]], list]
    suite: str                              # the `flashflow bench --suite` that times it against its anchors
    info_listing: Optional[Callable[[str], list]] = None
    info_shows_config: bool = False         # its info rows are config entries: the config names the case
    axes: dict = field(default_factory=dict)
    plan_options: tuple = ()
    config_classes: tuple = ()
    unit: Optional[str] = None
    anchor: Optional[str] = None
    tolerance: float = TOLERANCE
    tune_shapes: Optional[Callable] = None
    tune_case: Optional[Callable] = None
    tune_timing: str = "graph"
    tune_options: tuple = ()                # TuneOptions this op declares
    tune_takes: tuple = ()                  # dests of every op option it reads (its own and shared ones)
    tune_check: Optional[Callable] = None   # args -> None; ValueError with the fix (run before the GPU is looked for)
    # tune option dest -> tolerance while it is set (an FP8 cache against a bf16 anchor)
    option_tolerances: dict = field(default_factory=dict)
    # tune option dests that name their own result file (tune-OP-FLAG-<device>.json)
    result_flags: tuple = ()

    @property
    def tunable(self) -> bool:
        return bool(self.axes)

    def fields(self) -> tuple[str, ...]:
        """Every name ``--vary`` takes: the configs' fields, then the plan options."""
        names = [f.name for cls in self.config_classes for f in dataclasses.fields(cls)] + list(self.plan_options)
        return tuple(dict.fromkeys(names))

    def tolerance_for(self, args) -> float:
        return next((t for dest, t in self.option_tolerances.items() if getattr(args, dest, False)), self.tolerance)

    def result_suite(self, args) -> str:
        return "-".join(["tune", self.name] + [d for d in self.result_flags if getattr(args, d, False)])


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``"64,128"`` -> ``(64, 128)``."""
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def replace_fields(base, overrides: dict, plan_options=()):
    """``base`` (a frozen config dataclass) with the overrides that are its fields replaced;
    NotApplicable if an override is neither its field nor a plan option, or changes nothing."""
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = [k for k in overrides if k not in fields and k not in plan_options]
    if unknown:
        raise NotApplicable(f"{', '.join(unknown)} not a field of {type(base).__name__}")
    mine = {k: v for k, v in overrides.items() if k in fields}
    return dataclasses.replace(base, **mine)


def same_as_shipped(base, overrides: dict, plan: dict) -> bool:
    """Whether a candidate only restates what ships (timed once, as ``shipped``)."""
    for k, v in overrides.items():
        current = getattr(base, k) if hasattr(base, k) else plan.get(k)
        if current != v:
            return False
    return True

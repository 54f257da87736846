"""The GPU kit's plan: its steps in order, the seconds each is planned at on an H200, and the
settings of its JAX points (docs/GPU_ACCEPTANCE.md: the arithmetic of one lease, the basis of
each figure).

A JAX point is a batch size, a population size and the trainer's config fields it sets
(`Point.overrides`, dotted names as on the trainer's command line). Adding a point is one row
of `PLAN`, placed where it should run, e.g. an A/B of the host's dispatch beside `b50`:

    Step("b50_k2", 70, Point(50, {"steps_per_dispatch": "2"})),
    Step("b50_graphs_MODE", 70, Point(50, {"mesh.cuda_graphs": "MODE"})),

Its CPU rehearsal (`--dry`) runs the same point at tiny shapes (`Point.dry`). The trainer run
(`train`) takes `TRAIN_OVERRIDES` on top of its own (`benchmarks/kit_train.py`).

A step starts only if its planned seconds fit in what is left of the command's budget, so the
figures below are what each step needs (measured on earlier leases, docs/GPU_ACCEPTANCE.md),
never less: a step that needs more than its plan is a bug of the plan.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Point:
  """A JAX point: `batch_size` sentences (two views each), `members` (> 1: a population) and the
  config fields it sets beside the bench's defaults (`model.attention` "fused" unless set; the
  kit turns it to "explicit" for every point when its gate did not prove the kernels)."""
  batch_size: int
  overrides: dict = dataclasses.field(default_factory=dict)
  members: int = 1

  def dry(self) -> "Point":
    """The CPU rehearsal's version: tiny batch, at most two members, the same fields."""
    return Point(4 if self.batch_size < 100 else 8, dict(self.overrides), min(self.members, 2))


@dataclasses.dataclass(frozen=True)
class Step:
  """One step of the kit: its name, its planned seconds on an H200 and, for a JAX point, its settings."""
  name: str
  planned_s: int
  point: Point | None = None


PLAN = (
    Step("gpu_tests", 110),      # the kernels' gate, their trial tests and the other GPU tests, at once (kit_gate)
    Step("caches", 15),
    Step("b50", 85, Point(50)),            # steps_per_dispatch and mesh.cuda_graphs as auto chooses them
    Step("b50_k1", 70, Point(50, {"steps_per_dispatch": "1"})),             # the host's A/B: one step per call
    Step("b50_fixed_graphs", 70, Point(50, {"mesh.cuda_graphs": "fixed"})),  # the CUDA graphs' A/B: never updated
    Step("kernel_variants", 20),
    Step("b512", 80, Point(512)),
    Step("ceilings", 10),
    Step("b50_torch_eager", 15),
    Step("b512_torch_eager", 15),
    Step("train", 160),          # the real trainer, about 1,500 steps (kit_train)
    # beyond one lease's two commands: each runs when a command has its time left
    Step("k5", 140, Point(50, members=5)),
    Step("b50_explicit", 70, Point(50, {"model.attention": "explicit"})),  # the kernels' A/B (measured at 056212b)
    Step("b50_no_graphs", 70, Point(50, {"mesh.cuda_graphs": "none"})),
    Step("b50_torch_compiled", 75),
    Step("b512_torch_compiled", 80),
)
STEPS = tuple((s.name, s.planned_s) for s in PLAN)
POINTS = {s.name: s.point for s in PLAN if s.point}
_NAMES = [s.name for s in PLAN]
LEASE_STEPS = tuple(_NAMES[:_NAMES.index("train") + 1])  # the lease's plan; the rest when a command has their time
DRY_STEP_S = 20  # on CPU every step is planned alike: the rehearsal runs them all
# One lease (docs/GPU_ACCEPTANCE.md): its device seconds, what is not a step (the machine's start,
# the wheels' install, each command's interpreter start and transfers, the idle gap between the
# two commands), the margin kept, and the two commands' budgets (`--budget_s`).
LEASE_S, START_S, INSTALL_S, PROCESS_S, TRANSFER_S, IDLE_S, MARGIN_S = 900, 90, 20, 10, 10, 30, 60
COMMAND_LIMIT_S = 600  # the device tool's limit on one command
COMMAND_BUDGETS_S = (490, 165)
# Config fields of the trainer run beside its own (kit_train.trainer_args), e.g. one step per call,
# {"steps_per_dispatch": "1"}; none: the trainer's defaults (steps_per_dispatch auto among them).
TRAIN_OVERRIDES: dict = {}


def point_for(name: str, dry: bool) -> Point:
  """The settings of JAX point `name` (its rehearsal's with `dry`)."""
  return POINTS[name].dry() if dry else POINTS[name]


def planned(dry: bool) -> dict[str, int]:
  """{step: planned seconds} (DRY_STEP_S each in a rehearsal)."""
  return {name: DRY_STEP_S if dry else s for name, s in STEPS}


def lease_seconds(budgets=COMMAND_BUDGETS_S) -> int:
  """Device seconds of a lease whose commands run `budgets` seconds of steps each: the start, the
  install, each command's process and transfers, the idle gaps between commands."""
  return (START_S + INSTALL_S + sum(PROCESS_S + b + TRANSFER_S for b in budgets)
          + IDLE_S * (len(budgets) - 1))

"""The `population.*` fields (K runs in one jitted step, `training/population.py`), added to every
config by `default`: what each one sets in the members' solo configs, declared once (`PER_MEMBER`).

`population.seeds = (s_0, ..., s_{K-1})` makes member i the solo run of the same config with
`seed = s_i`; each other field sets one more field of every member (`member_config`). A field the
step only scales by (the peak learning rate, the AMI weight λ) is no constant of the compiled
program: the step takes the members' values as an array (`PerMember.step_input`, read by
`training/step.py`), so other values need no other program. The config checks
(`config_checks.check_population`) and the resume check read the same table.
"""
from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class PerMember:
  """A `population.*` field: the member field it sets, and how."""
  field: str                     # the field of each member's solo config it sets, e.g. "optim.learning_rate"
  per_member: bool = True        # a tuple of one value per member; else one value for all (0: unset)
  step_input: str | None = None  # the step's hyper-parameter array that carries it (else a program constant)


PER_MEMBER = {
    "seeds": PerMember("seed"),                              # head init, dropout / AMI / momentum keys, data order
    "subset_seeds": PerMember("data.subset_seed"),           # a few-shot subset per member
    "num_sentences": PerMember("data.num_sentences", per_member=False),  # every member's subset size
    "learning_rates": PerMember("optim.learning_rate", step_input="learning_rate"),  # the schedule's peak
    "ami_weights": PerMember("ami.weight", step_input="ami_weight"),                 # λ of the AMI term
}
# A config.json written before a field existed lacks it; absent means this value (JSON form).
DEFAULTS = {f"population.{name}": ([] if f.per_member else 0) for name, f in PER_MEMBER.items()}


def add_population_fields(c: ml_collections.ConfigDict) -> None:
  """Adds the `population` group: every field of `PER_MEMBER` unset (a solo run)."""
  c.population = ml_collections.ConfigDict({name: (() if f.per_member else 0) for name, f in PER_MEMBER.items()})


def enabled(config: ml_collections.ConfigDict) -> bool:
  """Whether `config` asks for population training (`population.seeds` not empty)."""
  return bool(config.get("population", {}).get("seeds", ()))


def size(config: ml_collections.ConfigDict) -> int:
  """K, the number of members (0 without population training)."""
  return len(config.population.seeds) if enabled(config) else 0


def set_fields(config: ml_collections.ConfigDict) -> dict[str, object]:
  """{population field name: its value} of the fields `config` sets (not empty, not 0)."""
  group = config.get("population", {})
  return {name: group.get(name) for name in PER_MEMBER if group.get(name)}


def _set(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = type(node[leaf])(value)


def member_config(config: ml_collections.ConfigDict, index: int) -> ml_collections.ConfigDict:
  """Member `index`'s solo config: each set `population.*` field's value for it, no population field set."""
  member = ml_collections.ConfigDict(config.to_dict())
  for name, value in set_fields(config).items():
    spec = PER_MEMBER[name]
    _set(member, spec.field, value[index] if spec.per_member else value)
  add_population_fields(member)
  return member


def member_configs(config: ml_collections.ConfigDict) -> list[ml_collections.ConfigDict]:
  """The K members' solo configs, in the order of `population.seeds`."""
  return [member_config(config, i) for i in range(size(config))]


def step_inputs(config: ml_collections.ConfigDict) -> dict[str, list[float]]:
  """{step input name: the members' values} of the set fields the step takes as arrays."""
  return {PER_MEMBER[name].step_input: [float(v) for v in value] for name, value in set_fields(config).items()
          if PER_MEMBER[name].step_input}

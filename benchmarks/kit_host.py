"""What the GPU kit reports of the host's A/B at batch 50: b50 (steps per call and CUDA graphs as
`auto` chooses them) beside the rows that change one of them (`HOST_AB`, rows of `kit_plan.PLAN`)."""
from __future__ import annotations

HOST_AB = (("b50_k1", "one step per call"), ("b50_fixed_graphs", "CUDA graphs never updated"))


def _or_dash(x, fmt: str) -> str:
  return "—" if x is None else format(x, fmt)


def _dispatch(p: dict) -> str:
  """A point's steps per call and CUDA graphs, as the host's line shows them."""
  k = p.get("steps_per_dispatch")
  return f"{_or_dash(k, '')} step{'' if k == 1 else 's'} per call, CUDA graphs {p.get('cuda_graphs') or '—'}"


def host_line(s: dict) -> str:
  """The host's A/B at batch 50 (`HOST_AB`): b50's pipelined ms per training step beside each A/B
  row's that ran ok, the host's dispatch time per step in brackets, and each row's ratio to b50
  (above 1: b50's own choice is the faster); "" unless b50 and at least one of them ran."""
  ran = {p["name"]: p for p in s["points"] if p["ok"]}
  if "b50" not in ran or not any(name in ran for name, _ in HOST_AB):
    return ""
  b50 = ran["b50"]
  ms = lambda p: f"{p['pipelined_step_ms']:.2f} ({_or_dash(p.get('dispatch_step_ms'), '.2f')})"
  parts = [f"b50 ({_dispatch(b50)}) {ms(b50)}"]
  parts += [f"{what} ({name}: {_dispatch(ran[name])}) {ms(ran[name])}, "
            f"{ran[name]['pipelined_step_ms'] / b50['pipelined_step_ms']:.3f}x" for name, what in HOST_AB if name in ran]
  return ("the host's A/B at batch 50, the same machine, pipelined ms per training step (the host's dispatch "
          "in brackets): " + "; ".join(parts))

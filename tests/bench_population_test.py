"""`python -m micse_jax.bench --population_members`: the few-shot projection against a hand count
of the paper's protocol, one-line usage errors, and (slow) a real population measured on this CPU."""
import json

import pytest

from micse_jax.bench import __main__ as bench_main
from micse_jax.bench import population


def test_fewshot_projection_counts_the_papers_100_runs_in_populations(tmp_path):
  # fewshot: 4 methods x 5 sizes x 5 subset seeds = 100 runs of 20,000 steps; the 5 seeds of one
  # (method, size) differ only in population fields. K=1: 100 programs at 16 ms + a 60 s compile
  # each. K=2: 5 seeds -> 2+2+1 members = 3 programs per (method, size), 60 programs at 30 ms
  # (the 1-member leftover is a solo run at K=1's 16 ms) + 45 s compiles.
  measured = [{"members": 1, "ms_per_population_step": 16.0, "first_call_s": 60.0},
              {"members": 2, "ms_per_population_step": 30.0, "first_call_s": 45.0}]
  solo, pair = population.project_fewshot(measured, str(tmp_path / "sweep"))
  assert (solo["runs"], solo["programs"], solo["program_steps"]) == (100, 100, 2_000_000)
  assert solo["step_hours"] == pytest.approx(2_000_000 * 16.0 / 3.6e6)
  assert solo["compile_hours"] == pytest.approx(100 * 60 / 3600)
  assert (pair["programs"], pair["program_steps"]) == (60, 1_200_000)
  assert pair["step_hours"] == pytest.approx((40 * 20_000 * 30.0 + 20 * 20_000 * 16.0) / 3.6e6)
  assert pair["hours"] == pytest.approx(pair["step_hours"] + 60 * 45 / 3600)


@pytest.mark.parametrize("members", ["0", "1,x", "", "2,-1"])
def test_bad_population_sizes_are_a_usage_error(members, capsys):
  with pytest.raises(SystemExit) as e:
    bench_main.parse_args(["--population_members", members])
  assert e.value.code == 2 and "--population_members" in capsys.readouterr().err


@pytest.mark.slow
def test_a_population_is_measured_here_and_projected(tmp_path, capsys):
  result = bench_main.main(["--population_members", "1,2", "--model", "tiny", "--batch_size", "4",
                            "--max_length", "16", "--steps", "2", "--warmup", "1",
                            "--output", str(tmp_path / "out.json")])
  solo, pair = result["population"]
  assert (solo["members"], pair["members"]) == (1, 2)
  for m in (solo, pair):
    assert m["first_call_s"] > 0 and m["member_steps_per_s"] == pytest.approx(
        1e3 * m["members"] / m["ms_per_population_step"])
  assert pair["gain_over_solo"] == pytest.approx(pair["member_steps_per_s"] / solo["member_steps_per_s"])
  assert [p["programs"] for p in result["fewshot_projection"]] == [100, 60]
  assert json.loads((tmp_path / "out.json").read_text())["population"] == json.loads(json.dumps(result["population"]))
  assert "member-steps/s" in capsys.readouterr().out

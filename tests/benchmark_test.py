"""The benchmark script runs end to end (tiny model, one step) and reports what it promises."""
import json

from benchmarks import train_step_bench


def test_benchmark_reports_jax_and_torch_step_times(tmp_path):
  out = tmp_path / "bench.json"
  result = train_step_bench.main(["--model", "tiny", "--batch_size", "4", "--max_length", "16",
                                  "--steps", "1", "--warmup", "1", "--output", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  for side in ("jax", "torch"):
    assert result[side]["step_ms"] > 0 and result[side]["sentences_per_s"] > 0
  assert result["speedup_vs_torch"] == result["torch"]["step_ms"] / result["jax"]["step_ms"]
  assert result["step_flops"] > 0

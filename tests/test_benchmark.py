"""The benchmark script runs and reports every case (never a speed: timing is noisy)."""
import json

import pytest

from trainer import benchmark


def test_benchmark_reports_every_case_with_flops(tmp_path, capsys):
    output = tmp_path / "bench.json"
    benchmark.main(["--model=cifar_cnn", "--model_size=tiny", "--dataset=synthetic",
                    "--batch_size=16", "--steps=2", "--rounds=1", "--steps_per_loop=1",
                    "--precision=float32", "--peak_size=256", f"--output={output}"])
    result = json.loads(output.read_text())
    names = [row["name"] for row in result["rows"]]
    assert names == ["ours", "model.fit", "ours, real input pipeline",
                     "ours, steps_per_loop=1", "ours, mixed_bfloat16", "ours, XLA on"]
    assert all(row["images_per_second"] > 0 for row in result["rows"])
    assert result["training_flops_per_image"] > 0
    assert set(result["peak_flops"]) == {"float32", "mixed_bfloat16"}
    table = capsys.readouterr().out
    assert table.count("\n| ") == 8  # header, rule, 6 cases and "MFLOP per training image" in table


def test_cases_subset_keeps_the_baseline_first():
    chosen = benchmark.cases("mixed_bfloat16", False, 10, ["precision"])
    assert [c.name for c in chosen] == ["ours", "ours, float32"]
    assert chosen[1].precision == "float32"


def test_unknown_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--cases=ours,speed"])
    assert exit_info.value.code == 2
    assert "unknown --cases speed" in capsys.readouterr().err

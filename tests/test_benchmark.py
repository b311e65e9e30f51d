"""The benchmark command runs and reports every case (never a speed: timing is
noisy). It runs in this process, with its own flag parsing (conftest's `command`)."""
import json
import re

import pytest

from trainer.tools import benchmark

BENCHMARK = "trainer.tools.benchmark"


@pytest.mark.long(32)  # seconds, with -n 2
def test_benchmark_reports_every_case_with_flops(tmp_path, command):
    output = tmp_path / "bench.json"
    status, stdout, log = command(
        BENCHMARK, "--model=cifar_cnn", "--model_size=tiny", "--dataset=synthetic",
        "--batch_size=16", "--steps=2", "--rounds=1", "--steps_per_loop=1",
        "--precision=float32", "--jit_compile=false", "--peak_size=256",
        f"--output={output}")
    assert status == 0, log[-2000:]
    measured = json.loads(output.read_text())
    names = [row["name"] for row in measured["rows"]]
    assert names == ["ours", "model.fit", "ours, real input pipeline",
                     "ours, steps_per_loop=1", "ours, mixed_bfloat16", "ours, XLA on"]
    assert all(row["images_per_second"] > 0 for row in measured["rows"])
    assert measured["training_flops_per_image"] > 0 and measured["replicas"] == 1
    assert set(measured["peak_flops"]) == {"float32", "mixed_bfloat16"}
    assert stdout.count("\n| ") == 8  # header, rule and 6 cases


@pytest.mark.long(16)  # seconds, with -n 2
def test_two_cpu_replicas_run_ours_and_fit_side_by_side(tmp_path, command):
    output = tmp_path / "bench.json"
    status, _, log = command(
        BENCHMARK, "--model=cifar_cnn", "--model_size=tiny", "--dataset=synthetic",
        "--batch_size=16", "--steps=2", "--rounds=1", "--cases=fit,xla",
        "--precision=float32", "--jit_compile=false", "--peak_size=256",
        "--cpu_replicas=2", f"--output={output}")
    assert status == 0, log[-2000:]
    measured = json.loads(output.read_text())
    assert measured["replicas"] == 2  # XLA is left out: it fails on 2 CPU devices
    assert [row["name"] for row in measured["rows"]] == ["ours", "model.fit"]


def test_cases_subset_keeps_the_baseline_first():
    chosen = benchmark.cases("mixed_bfloat16", False, 10, ["precision"])
    assert [c.name for c in chosen] == ["ours", "ours, float32"]
    assert chosen[1].precision == "float32"


def test_unknown_case_is_a_usage_error(command):
    status, _, log = command(BENCHMARK, "--cases=ours,speed")
    assert status == 2
    assert "unknown --cases speed" in log


def test_peer_benchmark_table_has_each_run_the_means_and_the_ratios():
    from trainer.tools import peer_benchmark
    rows = [{"side": side, "seed": seed, "tta_accuracy": accuracy, "train_seconds": seconds,
             "steps": 240, "images_per_second": 240 * 1024 / seconds}
            for side, seed, accuracy, seconds in (("peer", 0, 0.84, 120.0),
                                                  ("ours", 0, 0.85, 240.0),
                                                  ("ours", 1, 0.83, 240.0))]
    table = peer_benchmark.table(rows)
    assert table.count("\n| peer | 0 |") == 1 and table.count("\n| ours |") == 2
    assert "| **ours, mean** | 2 | 84 ± 1.4% | 240 ± 0 |" in table
    assert "ours/peer images per second: 0.50; ours - peer test accuracy: +0.00 points" in table


def test_conv_benchmark_reads_onednns_lines_and_counts_repeated_layers():
    from trainer.tools import conv_benchmark
    shapes = conv_benchmark.layers([64, 256, 256])
    assert shapes == [(31, 24, 64), (15, 64, 64), (15, 64, 256), (7, 256, 256),
                      (7, 256, 256), (3, 256, 256)]
    problem = "mb8_ic256oc256_ih7oh7kh3sh1dh0ph1_iw7ow7kw3sw1dw0pw1"

    def exec_line(direction, ms):
        return (f"onednn_verbose,v1,primitive,exec,cpu,convolution,jit_bf16:avx512_core_bf16,"
                f"{direction},src:bf16::blocked:acdb::f0,,alg:convolution_direct,"
                f"{problem},{ms}")
    output = "\n".join([
        "onednn_verbose,v1,info,oneDNN v3.7.3 (commit N/A)",
        "onednn_verbose,v1,info,cpu,runtime:threadpool,nthr:2",
        "unrelated line",
        *(exec_line("backward_weights", ms) for ms in (90, 80, 10, 12, 11)),
    ])
    parsed = conv_benchmark.parse_verbose(output)
    assert parsed["version"] == "v3.7.3" and parsed["runtime"] == "threadpool"
    assert parsed["ms"] == {("backward_weights", problem): 11}  # warm-up left out
    table = conv_benchmark.table({"tf": parsed, "torch": parsed}, [(7, 256, 256)] * 2, 8)
    assert "| 7x7 256->256 (x2) | backward_weights | 11.0 | 11.0 | 1.00 |" in table
    assert "| **all six** | backward_weights | 22.0 | 22.0 | 1.00 |" in table


def test_host_loop_benchmark_reads_ours_from_its_log_lines_and_tabulates_the_ratios():
    from trainer.tools import host_loop_benchmark as host
    line = ("I1207 20:17:25.395929 140275031108480 progress.py:173] step 200/1200  epoch "
            "0.16  loss 2.3332  lr 0.001  132 img/s  ETA 0:00:07\n")
    assert host._seconds(line) == (20 * 3600 + 17 * 60 + 25.395929, 200)
    assert host._seconds("I1207 20:17:25.39 1 loop.py:1] Tracing the step\n") is None
    rows = [{"replicas": 1, "steps_per_loop": 1,
             "steps_per_second": {"bare": [50.0, 60.0, 55.0], "fit": [40.0, 44.0, 42.0],
                                  "ours": [52.0, 53.0, 51.0]}}]
    table = host.markdown(rows)
    assert "| 1 | 1 | 55.0 (50, 60, 55) | 42.0 (40, 44, 42) | 52.0 (52, 53, 51) | 0.95 | 1.24 |" \
        in table
    rows[0]["steps_per_second"]["fit"] = [None]  # (a case whose process failed)
    assert "| 55.0 (50, 60, 55) | failed | 52.0 (52, 53, 51) | 0.95 | - |" in host.markdown(rows)


@pytest.mark.long(12)  # seconds, with -n 3
def test_input_benchmark_reads_both_pipelines_and_gives_the_ratio(command):
    status, stdout, log = command(
        "trainer.tools.input_benchmark", "--dataset=cifar10", "--batch_size=16",
        "--batches=2", "--warmup=1", "--rounds=1", "--cache=memory")
    assert status == 0, log[-2000:]
    assert re.search(r"\n\| ours \| [\d,]+ \| [\d,]+ \|", stdout), stdout
    assert re.search(r"\n\| reference \| [\d,]+ \| [\d,]+ \|", stdout), stdout
    assert re.search(r"ours / reference: \d+\.\d\d", stdout), stdout

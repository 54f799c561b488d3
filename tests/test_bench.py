"""The benchmark scripts at a tiny size: scripts/bench.py prints one row per spec, each measured in its own process;
scripts/bench_cpu.py times the three products of every Linear shape."""

import pytest

from conftest import run_script

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--vocab_size=64", "--steps=1", "--warmup=1"]


def table(stdout, first_cell):
    """The rows of a ' | '-separated table whose header starts with first_cell, as lists of cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_cell + " | "))
    rows = []
    for line in lines[start:]:
        if " | " not in line:
            break
        rows.append(line.split(" | "))
    return rows


@pytest.mark.slow
def test_bench_prints_a_row_per_spec_relative_to_det(tmp_path):
    specs = ["det", "free:latent_bits=4", "btrans"]
    proc = run_script("-m", "scripts.bench", f"--models={','.join(specs)}", *TINY, "--block_size=16",
                      "--batch_size=2", "--decode_contexts=8,", "--decode_tokens=3", data_dir=tmp_path)
    header, *rows = table(proc.stdout, "model")
    assert [r[0] for r in rows] == specs
    cells = [dict(zip(header, r)) for r in rows]
    assert cells[0]["x det time"] == "1.00" and cells[0]["x det FLOPs"] == "1.00"
    assert float(cells[1]["x det FLOPs"]) > 1  # the Free Transformer's encoder block
    assert all(float(c["ms/step"]) > 0 and float(c["peak MiB"].replace(",", "")) > 0 for c in cells)
    assert all("dec@8 ms" in c and "nocache@8 ms" in c for c in cells)


@pytest.mark.slow
def test_bench_cpu_times_three_products_per_linear_shape(tmp_path):
    proc = run_script("-m", "scripts.bench_cpu", "--linears=True", *TINY, "--block_size=16", "--batch_size=2",
                      data_dir=tmp_path)
    header, *rows = table(proc.stdout, "Linear")
    shapes = {r[1] for r in rows}
    assert len(rows) == 3 * len(shapes) and {r[2] for r in rows} == {"x W^T", "g W", "g^T x"}
    assert all(float(r[-1]) > 0 for r in rows)

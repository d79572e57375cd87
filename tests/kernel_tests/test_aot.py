"""Ahead-of-time compilation for GPUs that are not here (Triton's own compiler and the
ptxas it ships): the kernel must build for sm_70, sm_80 and sm_90, and on sm_70 at head
dim 128 it must not spill."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.deploy.conftest import ROOT


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    subprocess.run([sys.executable, "-m", "prefill_gate.kernels.aot", "--arch", "70", "80", "90", "--json", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())["reports"]


def test_builds_for_every_target(reports):
    built = {(r["arch"], r["kernel"], r["split"]) for r in reports}
    for arch in (70, 80, 90):
        assert {(arch, "_tile_attention", True), (arch, "_tile_attention", False),
                (arch, "_merge_splits", True)} <= built
        assert {(arch, "_gated_delta_kernel", False), (arch, "_gated_delta_kernel", True)} <= built  # GDN, plain
        # and with its token loop pipelined
    assert {r["dtype"] for r in reports if r["arch"] == 70} == {"fp16"}  # V100 has no bf16
    assert {r["dtype"] for r in reports if r["arch"] != 70} == {"bf16"}


def test_no_spills_at_head_dim_128_on_sm70(reports):
    sm70 = [r for r in reports if r["arch"] == 70 and r["head_dim"] == 128]
    assert sm70
    for r in sm70:
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0, r
        assert 0 < r["registers"] <= 255


def test_the_gdn_recurrence_keeps_its_state_tile_in_registers(reports):
    """A 32 x 128 float32 state tile per program: a spill would put every token's update through
    local memory."""
    rows = [r for r in reports if r["kernel"] == "_gated_delta_kernel" and r["chunk"] == 0]
    assert {(r["arch"], r["split"]) for r in rows} == {(a, p) for a in (70, 80, 90) for p in (False, True)}
    for r in rows:
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0, r


def test_the_gdn_chunks_build_and_fit_on_hopper(reports):
    """Prompts in chunks of 16 (PREFILL_GATE_GDN_CHUNK=16, the kernel's chunk launch shape: 16
    value rows, 8 warps) build for sm_80 and sm_90, and there the state tile, the chunk's q/k
    tiles and its matrix products fit the registers (chunks of 32 spill: bench only)."""
    rows = {r["arch"]: r for r in reports if r["kernel"] == "_gated_delta_kernel" and r["chunk"] == 16}
    assert set(rows) == {80, 90} and {r["num_warps"] for r in rows.values()} == {8}
    for r in rows.values():
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0, r


def test_the_gdn_convolution_builds_for_every_target_without_spills(reports):
    """causal_conv's kernel (PREFILL_GATE_GDN_CONV=ours): what the interpreter ran, the compiler
    takes, for sm_70 (fp16), sm_80 and sm_90 (bf16)."""
    rows = {r["arch"]: r for r in reports if r["kernel"] == "_causal_conv_kernel"}
    assert set(rows) == {70, 80, 90}
    for r in rows.values():
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0 and 0 < r["registers"] <= 255, r


def test_the_prompts_walk_shapes_build_without_spills_and_one_warp_needs_no_cross_warp_sums(tmp_path):
    """PREFILL_GATE_GDN_WALK's shapes (the prompts' own launch, loading ahead) build for sm_90
    with the state tile in registers; with one warp a program the token loop's reductions stay
    within the warp (shuffles, a barrier or so for layout changes), where the default 4-warp
    program sums across warps through shared memory, behind 14 barriers a token. That
    difference is what the walk setting is for (bench/gdn_walks_aot.py; a GPU run times it). The
    first row is the one launch without the setting."""
    from prefill_gate.kernels.aot import WALKS

    out = tmp_path / "walks.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    subprocess.run([sys.executable, "bench/gdn_walks_aot.py", "--arch", "90", "--json", str(out)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=600)
    data = json.loads(out.read_text())
    one = next(r for r in data["rows"] if r["launch"] == "one launch")
    rows = {(r["rows"], r["warps"]): r for r in data["rows"] if r["launch"] != "one launch"}
    assert set(rows) == set(WALKS) and (one["rows"], one["warps"]) == (32, 4) and "git_commit" in data
    for shape, r in [*rows.items(), ("one launch", one)]:
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0, (shape, r)
        assert r["instructions"] > 0 and r["shuffles"] > 0, (shape, r)
    assert one["barriers"] >= 10
    assert all(r["barriers"] <= 3 for (_, w), r in rows.items() if w == 1), rows
    assert rows[(8, 1)]["instructions"] < one["instructions"] / 2

"""bench/gpu/gdn_sweep.py's choice of PREFILL_GATE_GDN_CHUNK and _RECURRENT from a sweep (the
sweep itself needs a GPU; bench/gpu/gdn_h200.sh's hybrid stage starts its server with the
choice). Rows here are made up, shaped as the sweep writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the choice reads the kernel's launch defaults")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import gdn_sweep  # noqa: E402


def row(prompt, shape, ours, stock=1.0, out_rel=0.006, decodes=True):
    return {"prompt": prompt, "shape": shape, "ours_wall_ms": ours, "stock_wall_ms": stock, "out_rel": out_rel,
            "decode_out_equal": decodes}


def test_the_longest_limit_wins_among_what_the_patch_can_run():
    rows = []
    for n in (16, 256, 512, 1024, 2048):
        rows.append(row(n, "32x1", 0.15 + 0.0018 * n))  # the token walk: pays to 512
        rows.append(row(n, "16x1x16x8", 0.12 + 0.0003 * n))  # chunks of 16: to 2048
        rows.append(row(n, "32x1x16x8", 0.10 + 0.0001 * n))  # faster, but not a shape the patch launches
    choice = gdn_sweep.choose(rows)
    assert (choice["chunk"], choice["limit"], choice["shape"], choice["walk"]) == (16, 2048, "16x1x16x8", None)
    assert gdn_sweep.deployable("32x1x16x8") is None and gdn_sweep.deployable("32x1") == {"chunk": 0, "walk": None}
    assert gdn_sweep.deployable("w8x1") == {"chunk": 0, "walk": "8x1"}


def test_a_walk_of_its_own_for_prompts_is_chosen_where_it_pays_longer():
    """The prompts' own launch (PREFILL_GATE_GDN_WALK): deployable, chosen where its limit is the
    longest, and never where the decodes' outputs changed."""
    rows = []
    for n in (16, 256, 512, 1024):
        rows.append(row(n, "32x1", 0.15 + 0.0018 * n))  # pays to 512
        rows.append(row(n, "w8x1", 0.16 + 0.0007 * n))  # pays to 1024
        rows.append(row(n, "w4x1", 0.16 + 0.0004 * n, decodes=n < 1024))  # faster, but a decode changed
    choice = gdn_sweep.choose(rows)
    assert (choice["chunk"], choice["walk"], choice["limit"], choice["shape"]) == (0, "8x1", 1024, "w8x1")
    with pytest.raises(SystemExit, match="wROWSxWARPS"):
        gdn_sweep.launch_shape("w8x1x2")


def test_a_limit_ends_at_the_first_length_that_fails_and_none_may_pay():
    rows = [row(16, "16x1x16x8", 0.2), row(256, "16x1x16x8", 0.3, out_rel=0.05),  # too far from vLLM's
            row(512, "16x1x16x8", 0.4), row(16, "32x1", 0.2), row(256, "32x1", 0.5, decodes=False)]
    assert gdn_sweep.choose(rows)["limit"] == 16
    assert gdn_sweep.choose([row(16, "32x1", 1.2), row(256, "32x1", 0.5)]) is None  # slower at the shortest


def test_the_hybrid_stage_reads_the_choice(tmp_path):
    sweep = tmp_path / "sweep.json"
    read = [sys.executable, str(ROOT / "bench/gpu/gdn_sweep.py"), "--choice", "--json", str(sweep)]
    sweep.write_text(json.dumps({"rows": [], "choice": {"chunk": 16, "limit": 2048}}))  # a sweep from before walks
    assert subprocess.run(read, capture_output=True, text=True, check=True).stdout.split() == ["16", "2048", "off"]
    sweep.write_text(json.dumps({"rows": [], "choice": {"chunk": 0, "limit": 512, "walk": None}}))
    assert subprocess.run(read, capture_output=True, text=True, check=True).stdout.split() == ["off", "512", "off"]
    sweep.write_text(json.dumps({"rows": [], "choice": {"chunk": 0, "limit": 1024, "walk": "8x1"}}))
    assert subprocess.run(read, capture_output=True, text=True, check=True).stdout.split() == ["off", "1024", "8x1"]
    sweep.write_text(json.dumps({"rows": [], "choice": None}))
    assert subprocess.run(read, capture_output=True, text=True, check=True).stdout.split() == ["off", "off", "off"]


def test_the_kernel_timing_runs_end_to_end_under_the_interpreter(tmp_path):
    """bench/gpu/gdn_kernel_time.py (our kernel alone, no vLLM) on tiny heads: the rows it
    writes, the chunked path's distance from the token walk, the environment."""
    import os

    out = tmp_path / "k.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu/gdn_kernel_time.py"), "--json", str(out),
                           "--device", "cpu", "--sizes", "2,4,16,16", "--lens", "8,40", "--chunks", "16",
                           "--walks", "4x1", "--runs", "1"], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [(r["prompt"], r["path"]) for r in data["rows"]] == [
        (8, "token walk"), (8, "chunk 16"), (8, "walk 4x1"), (40, "token walk"), (40, "chunk 16"), (40, "walk 4x1")]
    assert all(r["out_rel"] < 1e-5 and r["state_rel"] < 1e-5 and r["ms"] > 0 for r in data["rows"])
    assert all(r["decodes_equal"] for r in data["rows"] if r["path"] == "walk 4x1")  # the decodes' launch is theirs
    assert all(r["x_token"] == 1.0 for r in data["rows"] if r["path"] == "token walk")
    assert "git_commit" in data and data["device"] == "cpu" and "token walk" in done.stdout


def test_the_decode_bits_check_runs_end_to_end_under_the_interpreter(tmp_path):
    """bench/gpu/gdn_decode_bits.py on tiny heads: a row per launch shape, the token walk's own
    row identical to itself, every prompt within rounding (the interpreter gives the decodes the
    same bits at every shape; the H100 did not for chunks of 16)."""
    import os

    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu/gdn_decode_bits.py"), "--json", str(out),
                           "--device", "cpu", "--small"], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["shape"] for r in data["rows"]] == ["walk 32x4", "walk 16x8", "chunk 16 (16x8)", "chunk 32 (16x8)"]
    assert data["rows"][0]["decode_out_max_diff"] == 0 and data["rows"][0]["prompt_out_rel"] == 0
    assert all(r["decode_out_equal"] and r["decode_state_equal"] and r["prompt_out_rel"] < 1e-4 for r in data["rows"])
    assert "git_commit" in data


def test_the_kernel_stage_sweeps_only_shapes_the_kernel_launches():
    """bench/gpu/gdn_h200.sh's default --shapes, each launched once on a tiny step (under the
    interpreter here, on the GPU before the sweep's first row there): until this check, the list
    still named chunks of 64, which the kernel refuses, so the stage would have stopped after
    spending its GPU time on the rows before it."""
    import re

    text = (ROOT / "bench/gpu/gdn_h200.sh").read_text()
    shapes = re.search(r'--shapes "\$\{SHAPES:-([^}]*)\}"', text).group(1).split(",")
    assert "w8x1" in shapes and "32x1" in shapes
    gdn_sweep.check_shapes([gdn_sweep.launch_shape(x) for x in shapes], "cpu")
    with pytest.raises(SystemExit, match="16x1x64x8: chunk must be 0 or a power of two in 16..32"):
        gdn_sweep.check_shapes([gdn_sweep.launch_shape("16x1x64x8")], "cpu")
    with pytest.raises(SystemExit, match="w8x3: walk: value rows a power of two"):
        gdn_sweep.check_shapes([gdn_sweep.launch_shape("w8x3")], "cpu")


def test_the_convolution_timing_runs_end_to_end_under_the_interpreter(tmp_path):
    """bench/gpu/gdn_conv_time.py (vLLM's convolution against ours) on a narrow float32 layer
    under the interpreter: a row per way, the same bits from all three, the environment."""
    import os

    pytest.importorskip("vllm")
    out = tmp_path / "c.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu/gdn_conv_time.py"), "--json", str(out),
                           "--device", "cpu", "--small", "--calls", "2", "--repeats", "1", "--prompt", "20"], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["conv"] for r in data["rows"]] == ["vLLM's causal_conv1d_fn", "ours, fast launch",
                                                 "ours, Triton's launch"]
    assert data["same_bits"] is True and all(r["host_us"] > 0 for r in data["rows"])
    assert "git_commit" in data and "same bits all ways: True" in done.stdout

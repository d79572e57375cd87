"""bench/gpu's scripts on two simulators (DRY_RUN=1), the way they run on the device: what
breaks there costs a device call, so their plumbing is checked here. ``defaults_h200.sh`` judges
the hybrid class (short part, --checks hybrid), then the dense one; the servers the first left up
(they outlive a call, as on the device) belong to another class, so the second stops them
instead of measuring them."""

from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_defaults_script_judges_the_hybrid_then_replaces_its_servers_for_the_dense_class(tmp_path):
    ports = [free_port(), free_port()]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DRY_RUN": "1",
           "STOCK_PORT": str(ports[0]), "PACED_PORT": str(ports[1]), "SERVERS_MARK": str(tmp_path / "mark")}
    env.pop("TRITON_INTERPRET", None)

    def run(out: str, **settings) -> str:
        done = subprocess.run(["bash", "bench/gpu/defaults_h200.sh", str(tmp_path / out)], cwd=ROOT,
                              env={**env, **settings}, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    try:
        text = run("hybrid", CLASS="hybrid", ROWS="direct,stack", PARTS="short", SHORT_DURATION="4")
        merged = json.loads((tmp_path / "hybrid" / "defaults.json").read_text())
        assert merged["suite"] == "hybrid" and set(merged["rows"]) == {"direct", "stack"}
        assert all(set(parts) == {"short"} for parts in merged["rows"].values())
        assert {c["metric"] for c in merged["checks"]} == {"short_cost_x_step_p50", "short_cost_x_step_max"}
        assert "x step p50" in text and "stopping it" not in text
        # What a device call brings back (8 files at most): the logs in one tarball.
        out = tmp_path / "hybrid"
        kept = sorted(p.name for p in out.iterdir() if p.is_file())
        assert len(kept) <= 8 and "defaults-logs.tar.gz" in kept, kept
        with tarfile.open(out / "defaults-logs.tar.gz") as logs:
            assert {Path(n).name for n in logs.getnames()} >= {"gc-pauses.log", "jit-in-service.log",
                                                               "paced-server.log", "proxy-decisions.log"}
        assert "some will stay behind" not in text
        mark = (tmp_path / "mark").read_text()
        assert mark.startswith("defaults hybrid ") and "PREFILL_GATE_GDN_GRAPH=on" in mark  # the stack as shipped
        probe = tmp_path / "hybrid" / "work" / "host-probe.jsonl"  # the host's speed beside the run
        assert probe.read_text().count("\n") >= 5 and '"samples":' in text
        left = subprocess.run(["pgrep", "-f", str(probe)], capture_output=True, text=True)
        assert left.stdout == "", left.stdout  # the probe ends with the call

        text = run("dense", ROWS="direct", PARTS="pair", PAIR_RUNS="1")
        assert text.count("is not this run's (defaults hybrid") == 2, text  # both servers replaced
        assert json.loads((tmp_path / "dense" / "defaults.json").read_text())["suite"] == "defaults"
        assert "host direct pair: " in text  # whether the host was quiet during the part (host_probe --parts)

        # PROXY_ARGS: the proxy's parts again with another setting, in a variant's work folder
        text = run("dense", ROWS="proxy", PARTS="pair", PAIR_RUNS="1", PROXY_ARGS="--slice-inflight=2")
        assert "proxy settings: --slice-inflight=2" in text
        assert (tmp_path / "dense" / "work" / "variant-proxy-slice-inflight-2" / "proxy-pair.json").is_file()
        variant = json.loads((tmp_path / "dense" / "defaults.json").read_text())
        assert set(variant["rows"]) == {"proxy"} and "--proxy-arg=--slice-inflight=2" in variant["command"]
    finally:
        for port in ports:
            subprocess.run(["pkill", "-INT", "-f", "--", f"--port {port} "], check=False)


@pytest.mark.slow
def test_one_server_at_a_time_runs_the_rows_of_each_in_its_own_call(tmp_path):
    """ONE_SERVER=1 (auto on a card that holds one 27B hybrid server, an 80 GB H100): a call runs
    the rows of one server only and stops the other first; the parts meet in one defaults.json."""
    ports = [free_port(), free_port()]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DRY_RUN": "1",
           "STOCK_PORT": str(ports[0]), "PACED_PORT": str(ports[1]), "SERVERS_MARK": str(tmp_path / "mark"),
           "CLASS": "hybrid", "ONE_SERVER": "1", "PARTS": "short", "SHORT_DURATION": "4"}
    env.pop("TRITON_INTERPRET", None)

    def run(rows: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "bench/gpu/defaults_h200.sh", str(tmp_path / "out")], cwd=ROOT,
                              env={**env, "ROWS": rows}, capture_output=True, text=True, timeout=400)

    def up(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        both = run("direct,stack")
        assert both.returncode == 2 and "one server at a time" in both.stdout, both.stdout[-2000:]
        assert not up(ports[0]) and not up(ports[1])  # refused before starting either

        stale = tmp_path / "out" / "work" / "paced-trace.jsonl"  # an earlier paced server's trace
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text('{"step": 1}\n')
        first = run("direct")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert up(ports[0]) and not up(ports[1])
        assert not (tmp_path / "out" / "paced-trace.jsonl.gz").exists()  # not this call's server's

        env["TRACE"] = "1"
        second = run("stack")
        del env["TRACE"]
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert f"stopping the server on :{ports[0]}" in second.stdout
        assert not up(ports[0]) and up(ports[1])
        merged = json.loads((tmp_path / "out" / "defaults.json").read_text())
        assert set(merged["rows"]) == {"direct", "stack"}
        assert {c["metric"] for c in merged["checks"]} == {"short_cost_x_step_p50", "short_cost_x_step_max"}

        assert (tmp_path / "out" / "paced-trace.jsonl.gz").exists()
        # CONTROL: the paced server's part again under another target, on the same server, which
        # keeps its trace without TRACE=1 here (a server started with it is still this run's)
        control = tmp_path / "out" / "work" / "control.env"
        env["CONTROL"] = "PREFILL_GATE_PACING_TARGET_ITL_MS=40"
        variant = run("stack")
        assert variant.returncode == 0, variant.stdout[-3000:] + variant.stderr[-3000:]
        assert "stopping the server" not in variant.stdout and up(ports[1])
        assert (tmp_path / "out" / "paced-trace.jsonl.gz").exists()
        assert "control: PREFILL_GATE_PACING_TARGET_ITL_MS=40" in variant.stdout and "target 40.0 ms" in variant.stdout
        assert (tmp_path / "out" / "work" / "variant-PACING-TARGET-ITL-MS-40").is_dir()
        assert control.read_text() == ""  # the server's own settings back
        again = json.loads((tmp_path / "out" / "defaults.json").read_text())
        assert set(again["rows"]) == {"stack"}  # measured anew, not the earlier part's file
        env["CONTROL"] = "PREFILL_GATE_PACING_TARGET_ITL_MS=fast"
        refused = run("stack")
        assert refused.returncode == 2 and "CONTROL refused" in refused.stdout and control.read_text() == ""
        env["CONTROL"] = "VLLM_ATTENTION_BACKEND=X"
        assert run("stack").returncode == 2
    finally:
        for port in ports:
            subprocess.run(["pkill", "-INT", "-f", "--", f"--port {port} "], check=False)


def test_stage_builds_what_a_device_call_ships_and_its_check_finds_what_is_wrong(tmp_path):
    """bench/gpu/stage.sh with the vLLM chunks already there (building them needs PyPI and ~3
    min): it adds the setup script, both model folders, the entry points, and checks it all."""
    shared, stage, wheels = tmp_path / "shared", tmp_path / "stage", tmp_path / "whl"
    shared.mkdir()
    (shared / "device_setup.sh").write_text("echo setup\n")
    (shared / "make_model.py").write_text(  # the recipe's model maker, reduced to the files it writes
        "import json, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True)\n"
        "(out / 'config.json').write_text(json.dumps({'architectures': ['Qwen3ForCausalLM']}))\n"
        "for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'generation_config.json'):\n"
        "    (out / name).write_text('{}')\n")
    for i, part in enumerate(("p1", "p2", "p3")):
        (stage / part).mkdir(parents=True)
        (stage / part / f"slim.tar.xz.part0{i}").write_bytes(b"x" * 100)
        (stage / part / "slim.tar.xz.sha256").write_text("abc\n")
    wheels.mkdir()
    (wheels / "httptools-0.9.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"w")
    env = {**os.environ, "STAGE_DIR": str(stage), "WHEEL_DIR": str(wheels), "SHARED_GPU": str(shared)}
    script = str(ROOT / "bench/gpu/stage.sh")
    done = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "staged:" in done.stdout
    assert (stage / "device_setup.sh").is_file() and (stage / "model-hybrid-27b" / "config.json").is_file()
    assert json.loads((stage / "model-hybrid-27b" / "config.json").read_text())["architectures"] != ["Qwen3ForCausalLM"]
    assert list((stage / "ep").glob("*.dist-info/entry_points.txt"))
    (stage / "p2" / "slim.tar.xz.sha256").write_text("def\n")  # a chunk of another build
    (stage / "model-qwen3-8b" / "tokenizer.json").unlink()
    check = subprocess.run(["bash", script, "--check"], env=env, capture_output=True, text=True, timeout=60)
    assert check.returncode == 1
    assert "stale:" in check.stdout and "model-qwen3-8b" in check.stdout and "staged:" not in check.stdout
    shutil.rmtree(stage / "p2")  # a chunk left behind: p1, p3
    gap = subprocess.run(["bash", script, "--check"], env=env, capture_output=True, text=True, timeout=60)
    assert gap.returncode == 1 and f"missing: {stage}/p2" in gap.stdout

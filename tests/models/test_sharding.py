"""Tensor/data parallelism on 8 fake CPU devices: identical greedy output, really sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_jax.sharding import parse_mesh_spec

pytestmark = pytest.mark.slow  # subprocesses with 8 fake devices: minutes

WORKER = Path(__file__).with_name("sharding_worker.py")
MESHES = ["model=4", "model=8", "data=2,model=4"]  # tensor parallel at two widths, and both axes


def _run_worker(arch: str, specs: list[str]) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(WORKER), arch, *specs], capture_output=True, text=True,
                          env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama_runs():
    return _run_worker("llama", ["none", *MESHES])


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_greedy_output_identical(llama_runs, spec):
    base = llama_runs["none"]
    for method in ("none", "eagle3", "peagle", "peagle+ngram/2c"):
        assert llama_runs[spec][method] == base[method], (spec, method)
    assert base["peagle+ngram/2c"] == base["none"]


@pytest.mark.parametrize("spec", MESHES)
def test_parameters_really_sharded(llama_runs, spec):
    model = parse_mesh_spec(spec).get("model", 1)
    data = parse_mesh_spec(spec).get("data", 1)
    s = llama_runs[spec]["shardings"]
    # q_proj [D=64, H*hd=128]: columns split over `model`; replicated over `data`.
    assert s["q_proj"][0] == [None, "model"]
    assert s["q_proj"][1] == [64, 128 // model]
    assert s["q_proj"][2] == model * data
    assert s["down_proj"] == [["model", None], [128 // model, 64]]
    assert s["drafter_q_proj"] == [[None, "model"], [128, 128 // model]]
    assert s["embed"] == [["model", None], [128 // model, 64]]


def test_scanned_layers_sharded_and_identical(llama_runs):
    """The layers stacked under one scan, on two meshes: every method's greedy output equals the
    unsharded scan's and the unrolled model's; the stacked weights keep their layer axis whole."""
    runs = _run_worker("llama_scan", ["none", "model=4", "data=2,model=4"])
    for spec in ("model=4", "data=2,model=4"):
        for method in ("none", "eagle3", "peagle", "peagle+ngram/2c"):
            assert runs[spec][method] == runs["none"][method] == llama_runs["none"][method], (spec, method)
    s = runs["model=4"]["shardings"]
    assert s["q_proj"][0] == [None, None, "model"] and s["q_proj"][1] == [3, 64, 128 // 4]
    assert s["down_proj"] == [[None, "model", None], [3, 128 // 4, 64]]


@pytest.mark.slow
def test_moe_experts_sharded_and_identical():
    runs = _run_worker("qwen3_moe", ["none", "model=4"])
    for method in ("none", "eagle3", "peagle"):
        assert runs["model=4"][method] == runs["none"][method]
    assert runs["model=4"]["shardings"]["down_proj"] == [["model", None, None], [2, 32, 64]]


def test_sharded_server_identical_greedy_text():
    runs = _run_worker("serve", ["none", *MESHES])
    assert all(t for t in runs["none"])
    for spec in MESHES:
        assert runs[spec] == runs["none"], spec


def test_mesh_spec_validation():
    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh_spec(None) == {}
    for bad in ("data=2,model", "tensor=2", "model=0", "model=2,model=2"):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh_spec(bad)

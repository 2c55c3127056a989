"""scripts/profile_step.py's summaries on synthetic traces and memory snapshots (the
numbers worked out by hand)."""

import json
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import profile_step  # noqa: E402

GIB = 2**30


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def trace():
    return {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#6", "ts": 0, "dur": 900},
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#7", "ts": 1000, "dur": 5000},
        kernel("sm90_xmma_gemm_bf16", 500, 100),  # the step before: left out
        kernel("sm90_xmma_gemm_bf16", 1500, 1000),
        kernel("ncclDevKernel_AllToAll", 2000, 1000),  # overlaps the GEMM by 500 us
        kernel("triton_poi_fused_add_0", 4000, 500),
        kernel("_grouped_wgrad_kernel", 5800, 700),  # ends after the step's host span
    ]}


def test_step_time_splits_into_device_busy_and_the_rest():
    s = profile_step.summarize_trace(trace())
    assert s["step"] == "ProfilerStep#7"
    assert s["wall_ms"] == pytest.approx(5.5)  # 1000 .. 6500 us
    assert s["busy_ms"] == pytest.approx(2.7)  # 1500..3000, 4000..4500, 5800..6500
    assert s["other_ms"] == pytest.approx(2.8)
    assert s["groups"] == pytest.approx({"library GEMMs": 1.0, "communication": 1.0, "uniep GEMMs": 0.7,
                                         "triton (other)": 0.5})
    assert list(s["kernels"])[0] == "sm90_xmma_gemm_bf16"


def test_uniep_gemms_are_not_counted_as_library_gemms():
    assert profile_step.group_of("_grouped_gemm_kernel") == "uniep GEMMs"
    assert profile_step.group_of("cutlass_80_tensorop_gemm") == "library GEMMs"
    assert profile_step.group_of("void at::native::elementwise") == "other"


def test_memory_peak_rebuilt_backwards_from_the_snapshot():
    snapshot = {
        "segments": [{"device": 0, "blocks": [{"size": 100 * GIB, "state": "active_allocated"},
                                              {"size": 50 * GIB, "state": "active_allocated"},
                                              {"size": 70 * GIB, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "size": 200 * GIB}, {"action": "alloc", "size": 50 * GIB},
                           {"action": "free_requested", "size": 200 * GIB},
                           {"action": "free_completed", "size": 200 * GIB}, {"action": "alloc", "size": 100 * GIB}]],
    }
    m = profile_step.summarize_snapshot(snapshot)
    assert m["allocated_gib"] == pytest.approx(150)
    assert m["peak_gib"] == pytest.approx(250)  # after the second alloc
    assert m["peak_after_event"] == 1


def test_a_run_folder_is_read_from_its_last_iteration(tmp_path):
    for step, t in ((4, {"traceEvents": []}), (10, trace())):
        folder = tmp_path / "uniep" / "profile_traces" / f"iteration_{step}"
        folder.mkdir(parents=True)
        (folder / "rank0_trace.json").write_text(json.dumps(t))
    snap = tmp_path / "uniep" / "memory_snapshot" / "iteration_10"
    snap.mkdir(parents=True)
    (snap / "rank0_memory_snapshot.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    s = profile_step.summarize_run(tmp_path / "uniep")
    assert s["trace"].endswith("iteration_10/rank0_trace.json") and s["memory"]["peak_gib"] == 0


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="no ProfilerStep span or no device kernels"):
        profile_step.summarize_trace({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1",
                                                       "ts": 0, "dur": 1}]})
    with pytest.raises(SystemExit, match=r"no profile_traces/iteration_\*/rank0_trace.json"):
        profile_step.main(["summarize", str(tmp_path)])
    with pytest.raises(SystemExit):
        profile_step.main(["run", "no_such.toml", "--out", str(tmp_path), "--step", "3"])
    assert "--step 3: at least 4" in capsys.readouterr().err

"""benchmarks/cuda_check.py without a GPU: it says so and stops, and its RESULTS.md section
is rendered from a run's JSON as the run recorded it (no figure typed anywhere else)."""
import json
import os
import subprocess
import sys

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "cuda_check.py")

RUN = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.11.0+cu130", "date": "2026-11-25 17:14 UTC",
       "command": "python benchmarks/cuda_check.py --skip parity", "records": [
           {"check": "parity", "case": "llama-tiny/solved/inductor/1xnccl", "ranks": 1, "backend": "nccl",
            "ok": True, "worst_loss": 0.001, "worst_grad": 0.0197, "worst_param": 0.0, "steps": 10,
            "graph_breaks": 0},
           {"check": "parity", "case": "gpt-tiny/megatron/eager/4xcpu:gloo,cuda:gloo", "ranks": 4,
            "backend": "cpu:gloo,cuda:gloo", "ok": False,
            "error": "SpawnError: rank 0 failed:\nprocess exited with code -11 without reporting\n"
                     "(ranks [1, 2, 3] failed after it, probably as a consequence)"},
           {"check": "gloo-cuda", "op": "all_reduce", "ok": True},
           {"check": "gloo-cuda", "op": "send_recv", "ok": False,
            "error": "RuntimeError: pair.cc:339] writev: Bad address |  | (ranks [0, 1, 2] failed after it)"},
           {"check": "memory", "plan": "recompute", "compiler": "eager", "layout": "mesh 1", "ranks": 1,
            "backend": "nccl", "cluster": "dgx-h100", "model": "gpt-50m d1024 L4", "batch": 16, "seq": 512,
            "predicted_peak_bytes": 1986420740.0, "cuda_peak_bytes": 1717859328, "memory_error": 0.1563,
            "predicted_step_s": 0.08504, "measured_step_s": 0.0905, "time_error": -0.0603},
           {"check": "bf16-time", "model": "llama2-7b (4 layers)", "batch": 4, "seq": 2048, "compiler": "eager",
            "predicted_step_s": 0.1, "predicted_compute_s": 0.098, "predicted_optimizer_s": 0.002,
            "measured_step_s": 0.125, "measured_fwd_bwd_s": 0.12, "time_error": -0.2,
            "predicted_compute_by_kind_s": {"gemm": 0.06, "attention": 0.003, "other": 0.01, "optimizer": 0.002},
            "measured_kernels_s": {"gemm": 0.07, "attention": 0.006, "other": 0.012, "optimizer": 0.0,
                                   "top": [["nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", 0.05]]}},
           {"check": "bf16-time", "model": "llama2-7b", "ok": False, "error": "RuntimeError: out of memory"}]}


def test_without_cuda_it_says_so_and_stops():
    if torch.cuda.is_available():  # (on a GPU machine the script runs for real: nothing to check here)
        return
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_the_section_is_rendered_from_the_runs_json(tmp_path):
    js, md = tmp_path / "cuda.json", tmp_path / "cuda.md"
    js.write_text(json.dumps(RUN))
    proc = subprocess.run([sys.executable, SCRIPT, "--from-json", str(js), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = md.read_text()
    assert "Command: `python benchmarks/cuda_check.py --skip parity`" in text
    assert "| llama-tiny/solved/inductor | 1, nccl | 10 | 0.001 | 0.020 | 0.000 | 0 | pass |" in text
    assert "failed: a rank died with exit code -11 (SIGSEGV)" in text
    assert "`all_reduce` ran; `send_recv` failed: RuntimeError: pair.cc:339] writev: Bad address." in text
    assert "| recompute | eager | 1 | 1,894 | 1,638 | +15.6% | 85.0 | 90.5 | -6.0% |" in text
    assert "bf16 step time: llama2-7b (4 layers), batch 4 x seq 2048" in text
    assert "| eager | 100.0 | 2.0 | 125.0 | 120.0 | 5.0 | -20.0% |" in text
    assert "The bf16-time check failed: RuntimeError: out of memory." in text
    assert "| eager | gemm | 60.00 | 70.00 | 0.86 |" in text
    assert "| eager | attention | 3.00 | 6.00 | 0.50 |" in text
    assert "| eager | all but the optimizer | 73.00 | 88.00 | 0.83 |" in text
    assert "`nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT` 50.00 ms" in text


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cuda_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_and_ops_are_sorted_into_the_same_kinds():
    """A profile's kernels and the planner's ops land in the same four kinds (names as torch 2.11's
    CUDA 13 profiles print them on an H200)."""
    mod = _script()
    kernels = {"nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT": "gemm",
               "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
               "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>": "gemm",
               "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention",
               "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
               "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
               "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>>": "optimizer",
               "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other",
               "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other",
               "Memcpy DtoD (Device -> Device)": "other"}
    assert {k: mod.kernel_kind(k) for k in kernels} == kernels
    ops = {"aten.linear.default": "gemm", "aten.mm.default": "gemm", "aten.addmm.default": "gemm",
           "aten.scaled_dot_product_attention.default": "attention", "optimizer": "optimizer",
           "aten.rms_norm.default": "other", "aten.mul.Tensor": "other", "aten.embedding.default": "other"}
    assert {k: mod.op_kind(k) for k in ops} == ops


def test_compute_by_op_adds_up_to_the_breakdowns_compute():
    """The model's side of the kind table: the plan's compute split by op sums to its breakdown's."""
    from stpc.cli._common import meta_trace
    from stpc.planner import search
    from stpc.planner.summary import breakdown, compute_by_op

    tg, _, _ = meta_trace("llama-tiny", 2, 16, "fp32", 2)
    plan = search(tg, 2, cluster="dgx-h100")
    by_op = compute_by_op(plan)
    assert abs(sum(by_op.values()) - breakdown(plan)["compute_s"]) < 1e-9
    assert by_op["aten.linear.default"] > 0 and by_op["optimizer"] > 0
    assert by_op["aten.scaled_dot_product_attention.default"] > 0


def test_parity_families_picks_the_cases_it_names(monkeypatch):
    """``--parity-families dp``: only the data-parallel cases spawn ranks (each case's failure is its record)."""
    mod = _script()
    spawned = []

    def fake_spawn(fn, world, cases, **kw):
        spawned.append(cases[0]["id"])
        raise RuntimeError("no GPU here")
    monkeypatch.setattr(mod, "spawn", fake_spawn)
    recs = mod.parity(4, "gloo", 1, only=["dp"])
    assert spawned == ["gpt-tiny/dp/eager/4xgloo", "gpt-tiny/dp/inductor/4xgloo"]
    assert [r["ok"] for r in recs] == [False, False] and all("no GPU here" in r["error"] for r in recs)
    assert len(mod.parity(4, "gloo", 1, only=[])) == 0

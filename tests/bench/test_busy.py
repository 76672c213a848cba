"""The decode window's GPU profile (runtime/bench/busy.py), on synthetic Chrome traces built by
hand (the busy fraction, host gap and per-kernel table recomputed from the intervals), kernel
names as CUPTI reports them, and the profiler's own trace parsed on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.bench.busy import WINDOW, busy_from_trace, profile_busy, short_kernel_name, union_length

FILL_FLOAT = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
              "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)")
FILL_BF16 = FILL_FLOAT.replace("float", "c10::BFloat16")


def _window(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": WINDOW, "ts": ts, "dur": dur}


def _gpu(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_of_kernel_intervals():
    assert union_length([(0, 2), (1, 3), (5, 6)], (0, 10)) == 4  # overlaps count once
    assert union_length([(-5, 1), (9, 20)], (0, 10)) == 2  # clipped to the window
    assert union_length([], (0, 10)) == 0
    trace = {"traceEvents": [
        _window(100.0, 100.0),
        _gpu("a", 110.0, 50.0), _gpu("b", 140.0, 30.0), _gpu("c", 190.0, 20.0, "gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "name": "d", "ts": 100.0, "dur": 100.0},
    ]}
    got = busy_from_trace(trace)
    assert got["busy"] == pytest.approx(0.7) and got["kernels"] == 3 and got["window_ms"] == pytest.approx(0.1)


def test_profile_splits_each_step_into_gpu_time_and_host_gap():
    # a 4-step window of 4000 us; kernels cover [0,500) [400,900) [1000,2000) [3000,3100): union 2000 us
    trace = {"traceEvents": [
        _window(0.0, 4000.0),
        _gpu("gemm", 0.0, 500.0), _gpu("gemm", 400.0, 500.0), _gpu("_paged_decode_kernel", 1000.0, 1000.0),
        _gpu("Memcpy HtoD (Pageable -> Device)", 3000.0, 100.0, "gpu_memcpy"),
    ]}
    got = busy_from_trace(trace, steps=4)
    assert got["steps"] == 4
    assert got["busy"] == pytest.approx(2000 / 4000)
    assert got["window_ms_per_step"] == pytest.approx(1.0)
    assert got["gpu_ms_per_step"] == pytest.approx(0.5)
    assert got["host_gap_ms_per_step"] == pytest.approx(0.5)
    assert got["gpu_ms_per_step"] + got["host_gap_ms_per_step"] == pytest.approx(got["window_ms_per_step"])
    with pytest.raises(ValueError, match="steps"):
        busy_from_trace(trace, steps=0)


def test_launches_per_step_count_the_kernels_and_the_copies_in_the_window():
    # 3 steps; a CUDA graph's replay reports each of its kernels: 6 kernels, 2 copies and a memset
    # inside, a kernel straddling the window's start (it counts), CPU ops and a kernel after it (not)
    inside = [_gpu(f"k{i}", 100.0 + 50 * i, 10.0) for i in range(5)]
    trace = {"traceEvents": [
        _window(100.0, 300.0), _gpu("before", 95.0, 10.0), *inside,
        _gpu("Memcpy HtoD (Pinned -> Device)", 120.0, 5.0, "gpu_memcpy"),
        _gpu("Memcpy DtoH (Device -> Pinned)", 380.0, 5.0, "gpu_memcpy"),
        _gpu("Memset (Device)", 200.0, 1.0, "gpu_memset"),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 101.0, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 110.0, "dur": 5.0},
        _gpu("after", 400.0, 10.0),
    ]}
    got = busy_from_trace(trace, steps=3)
    assert got["launches_per_step"] == pytest.approx(6 / 3) and got["copies_per_step"] == pytest.approx(3 / 3)
    assert got["kernels"] == 9  # every GPU operation
    assert sum(r["calls"] for r in got["by_kernel"]) == 9


def test_kernel_table_groups_clips_and_sorts():
    trace = {"traceEvents": [
        _window(1000.0, 1000.0),
        _gpu(FILL_FLOAT, 900.0, 200.0),  # starts before the window: 100 us inside
        _gpu(FILL_BF16, 1200.0, 50.0),  # another instantiation of the same kernel: grouped
        _gpu("_paged_decode_kernel", 1300.0, 300.0),
        _gpu("_paged_decode_kernel", 1650.0, 300.0),
        _gpu("Memset (Device)", 1960.0, 100.0, "gpu_memset"),  # ends after the window: 40 us inside
        _gpu("_after_the_window", 2100.0, 500.0),  # outside: not counted
    ]}
    rows = busy_from_trace(trace, steps=2)["by_kernel"]
    assert [r["name"] for r in rows] == ["_paged_decode_kernel", "vectorized_elementwise_kernel<FillFunctor>",
                                         "Memset (Device)"]
    by_name = {r["name"]: r for r in rows}
    decode, fill, memset = rows
    assert (decode["calls"], decode["total_ms"], decode["ms_per_step"]) == (2, pytest.approx(0.6), pytest.approx(0.3))
    assert (fill["calls"], fill["total_ms"]) == (2, pytest.approx(0.15))
    assert (memset["calls"], memset["total_ms"]) == (1, pytest.approx(0.04))
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert by_name["_paged_decode_kernel"]["share"] == pytest.approx(600 / 790)


def test_trace_must_hold_one_window():
    with pytest.raises(RuntimeError, match="0 'kvc_decode_window' ranges"):
        busy_from_trace({"traceEvents": [_gpu("a", 0.0, 1.0)]})
    with pytest.raises(RuntimeError, match="2 'kvc_decode_window' ranges"):
        busy_from_trace({"traceEvents": [_window(0.0, 1.0), _window(5.0, 1.0)]})


@pytest.mark.parametrize("name, short", [
    (FILL_FLOAT, "vectorized_elementwise_kernel<FillFunctor>"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
     "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int)",
     "vectorized_elementwise_kernel<MulFunctor>"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>"
     "(at::TensorIteratorBase&)::{lambda(int)#1}>(int)", "elementwise_kernel<direct_copy_kernel_cuda>"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", "reduce_kernel<MeanOps>"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
     "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, long)", "indexSelectLargeIndex"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
     "Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"),
    ("_paged_decode_kernel", "_paged_decode_kernel"),  # Triton: the function's name
])
def test_short_kernel_names(name, short):
    assert short_kernel_name(name) == short


def test_long_names_are_cut():
    name = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
    assert short_kernel_name(name) == name
    cut = short_kernel_name(name, limit=20)
    assert len(cut) == 20 and cut.endswith("~") and name.startswith(cut[:-1])


def test_profiled_window_is_found_in_the_real_trace():
    x = torch.randn(64, 64)
    got = profile_busy(lambda: [x @ x for _ in range(10)], torch.device("cpu"), steps=10)
    assert got["window_ms"] > 0 and got["busy"] == 0.0 and got["kernels"] == 0  # no GPU, no kernels
    assert got["launches_per_step"] == 0 and got["copies_per_step"] == 0
    assert got["by_kernel"] == [] and got["steps"] == 10
    assert got["host_gap_ms_per_step"] == pytest.approx(got["window_ms"] / 10)


def test_host_ranges_and_waits_per_step():
    # 2 steps: the engine's ranges and the CUDA runtime's waits starting inside the window count, by name;
    # another annotation, a launch (not a wait) and a range starting after the window do not
    host = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        _window(0.0, 1000.0),
        host("user_annotation", "kvc.forward", 10.0, 200.0), host("user_annotation", "kvc.forward", 510.0, 200.0),
        host("user_annotation", "kvc.step_end", 220.0, 250.0), host("user_annotation", "other", 5.0, 900.0),
        host("cuda_runtime", "cudaStreamSynchronize", 300.0, 120.0), host("cuda_runtime", "cudaMemcpy", 430.0, 30.0),
        host("cuda_runtime", "cudaLaunchKernel", 20.0, 5.0), host("cuda_runtime", "cudaMemcpyAsync", 40.0, 5.0),
        host("user_annotation", "kvc.forward", 1200.0, 200.0),
    ]}
    got = busy_from_trace(trace, steps=2)
    ranges = {r["name"]: r for r in got["host_ranges"]}
    assert list(ranges) == ["kvc.forward", "kvc.step_end"]
    assert (ranges["kvc.forward"]["calls"], ranges["kvc.forward"]["ms_per_step"]) == (2, pytest.approx(0.2))
    assert ranges["kvc.step_end"]["total_ms"] == pytest.approx(0.25)
    waits = {r["name"]: r["total_ms"] for r in got["host_waits"]}
    assert waits == {"cudaStreamSynchronize": pytest.approx(0.12), "cudaMemcpy": pytest.approx(0.03)}


def test_engine_steps_name_their_host_ranges_in_a_profile():
    from kvc import LLM, SamplingParams

    llm = LLM("random:tiny", device="cpu", dtype="float32", method="snapkv",
              method_params={"budget": 16, "window": 4, "kernel": 3, "every": 2})
    engine = llm.engine
    engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    got = profile_busy(lambda: [engine.step() for _ in range(6)], engine.device, steps=6)
    names = {r["name"] for r in got["host_ranges"]}
    assert {"kvc.schedule", "kvc.forward", "kvc.sample", "kvc.commit", "kvc.step_end", "kvc.step_end.select",
            "kvc.step_end.compact"} <= names

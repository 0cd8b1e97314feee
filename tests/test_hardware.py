"""Hardware facts a node reports for the placer's CPU rule (SLINFER §V)."""


from shared.hardware import NoGPU, cpu_flags, detect_cpu, detect_gpu

SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Gold 6462C
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ICE_LAKE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8369B
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_vnni
"""


def test_amx_detected_from_cpuid_flags():
    info = detect_cpu(SAPPHIRE_RAPIDS)
    assert info.matrix_accel and info.flags == ["amx_bf16", "amx_int8", "amx_tile"]
    assert info.name == "Intel(R) Xeon(R) Gold 6462C" and info.cores >= 1


def test_third_gen_xeon_has_no_matrix_accelerator():
    info = detect_cpu(ICE_LAKE)
    assert not info.matrix_accel and info.flags == []
    assert "avx512_vnni" in cpu_flags(ICE_LAKE)


def test_this_machine_reports_memory_and_cores():
    info = detect_cpu()
    assert info.memory_bytes > 0 and info.cores >= 1


def test_no_gpu_is_a_clean_error_not_a_crash():
    try:
        info = detect_gpu()
    except NoGPU as exc:
        assert "no NVIDIA GPU" in str(exc)
    else:  # on a machine with a GPU: NVML's answer
        assert info.kind == "gpu" and info.memory_bytes > 0 and info.matrix_accel

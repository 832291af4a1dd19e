"""Which build of the native CPU kernels loads (cpu_native/build.py): the best x86-64 level the CPU's flags allow
(a mocked /proc/cpuinfo here: v4 with AVX-512 VNNI and BF16, v3 with AVX2/FMA/F16C, portable below), the
KUBEINFER_CPU_LEVEL override, a level the CPU lacks refused (the torch kernels then serve, with the warning), the
choice logged once and exported as kubeinfer:cpu_native_kernels_info's `level`, and the A16 layers' kernel taking
the native product on the v3 build as on v4."""
from __future__ import annotations

import logging

import pytest
from native_builds import levels_this_cpu_runs

from kubeinfer.engine.platforms.cpu.native import a16_method, build, ops

V3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe abm popcnt"  # an EPYC Rome, say
V4 = V3 + " avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16"
SKYLAKE_X = V3 + " avx512f avx512bw avx512vl avx512dq avx512cd"  # AVX-512 without VNNI or BF16
OLD = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx popcnt"  # Sandy Bridge: AVX without AVX2


def cpuinfo(flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\nbugs\t\t: none\n"


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv("KUBEINFER_CPU_LEVEL", raising=False)
    monkeypatch.delenv("KUBEINFER_CPU_NATIVE_PORTABLE", raising=False)


@pytest.mark.parametrize("flags,level",
                         [(V4, "v4"), (V3, "v3"), (SKYLAKE_X, "v3"), (OLD, "portable"), ("", "portable")])
def test_the_best_level_of_the_cpus_flags(flags, level):
    assert build.chosen_level(cpuinfo(flags), "x86_64")[0] == level


@pytest.mark.parametrize("wanted", ["v3", "portable"])
def test_the_override_picks_a_lower_level(monkeypatch, wanted):
    monkeypatch.setenv("KUBEINFER_CPU_LEVEL", wanted)
    assert build.chosen_level(cpuinfo(V4), "x86_64") == (wanted, "KUBEINFER_CPU_LEVEL")


def test_a_level_the_cpu_lacks_is_refused_with_its_missing_flags(monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_LEVEL", "v4")
    level, why = build.chosen_level(cpuinfo(V3), "x86_64")
    assert level is None and "avx512_bf16" in why and "avx512f" in why
    monkeypatch.setenv("KUBEINFER_CPU_LEVEL", "v3")
    assert build.chosen_level(cpuinfo(OLD), "x86_64")[0] is None


def test_a_refused_level_loads_nothing_and_the_torch_kernels_serve(monkeypatch, caplog):
    monkeypatch.setattr(build, "cpu_flags", lambda cpuinfo=None: set(V3.split()))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("KUBEINFER_CPU_LEVEL", "v4")
    monkeypatch.setattr(ops, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert not ops.available()
    assert ops.level() == "torch" and "lacks" in caplog.text


def test_the_portable_switch_is_the_portable_level(monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_PORTABLE", "1")
    assert build.chosen_level(cpuinfo(V4), "x86_64")[0] == "portable"


def test_other_machines_keep_one_native_build():
    level, why = build.chosen_level(cpuinfo("fp asimd"), "aarch64")
    assert level is None and "native" in why
    assert "-mcpu=native" in build.flags(False, None, None) or "-march=native" in build.flags(False, None, None)


def test_levels_build_apart_and_without_native_code():
    v3, v4 = build.flags(False, None, "v3"), build.flags(False, None, "v4")
    assert "-march=x86-64-v3" in v3 and "-march=x86-64-v4" in v4 and "-mavx512bf16" in v4
    assert not any("native" in f for f in v3 + v4 + build.flags(True))
    assert "-DKI_PORTABLE" in build.flags(False, None, "portable")


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler here: the torch kernels serve")
def test_each_level_this_cpu_runs_loads_logs_once_and_is_the_metric_label(monkeypatch, caplog):
    """Forced by the override: the library of that level (ki_level), one log line saying which and why, and the
    engine's metric naming it; the A16 kernel's vector path on v3 and v4, not on the portable C."""
    from kubeinfer.engine.entrypoints.metrics import cpu_native_kernels
    for level in levels_this_cpu_runs():
        monkeypatch.setenv("KUBEINFER_CPU_LEVEL", level)
        monkeypatch.setattr(ops, "_state", {})
        with caplog.at_level(logging.INFO, logger=ops.logger.name):
            caplog.clear()
            lib = ops.library()
            ops.library()
        assert lib.ki_level() == {"v4": 4, "v3": 3, "portable": 0}[level]
        lines = [r.getMessage() for r in caplog.records if "native CPU kernels: level" in r.getMessage()]
        assert lines == [f"native CPU kernels: level {level} (KUBEINFER_CPU_LEVEL)"]
        assert a16_method.fast() == (level != "portable")
        [family] = cpu_native_kernels(["m"])
        assert family.name == "kubeinfer:cpu_native_kernels_info"
        assert [(s.labels["level"], s.value) for s in family.samples] == [(level, 1)]
    monkeypatch.setattr(ops, "_state", {})
    assert list(cpu_native_kernels(["m"])) == []  # nothing asked for the kernels: no series



@pytest.mark.skipif(build.compiler() is None, reason="no C compiler here: the torch kernels serve")
def test_an_engine_gives_the_same_log_probs_on_every_level(tmp_path, monkeypatch):
    """A W4A16 (groups of 32) and a W8A16 (per channel) checkpoint of a float32 model served under each level this
    CPU runs: the default kernel the A16 product on v3 and v4 (torch's on the portable build, which it skips), the
    native decode layers on, and every generated token's log-probabilities the same bits on v3 as on v4."""
    from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint

    from kubeinfer.dev.testing.random_model import build_random_model
    from kubeinfer.engine import LLM, SamplingParams

    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=47, **SHAPE)
    schemes = {"w4": ("pack-quantized", 4, "int", "group", False, 32), "w8": ("pack-quantized", 8, "int", "channel",
                                                                            True, None)}
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    levels = [lv for lv in levels_this_cpu_runs() if lv != "portable"]
    if len(levels) < 2:
        pytest.skip(f"this CPU runs only {levels}")
    for name, scheme in schemes.items():
        config = ct_scheme(*scheme)
        path = write_checkpoint(float_dir, tmp_path / name, ct_compress(float_weights(float_dir), config), config)
        seen = {}
        for level in levels:
            monkeypatch.setenv("KUBEINFER_CPU_LEVEL", level)
            monkeypatch.setattr(ops, "_state", {})
            llm = LLM(str(path), max_model_len=64, num_kv_blocks=32)
            assert set(llm.engine.runner.model.quant_kernels.values()) == {f"cpu_int{name[1]}_a16"}
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            llm.shutdown()
            assert ops.level() == level
            seen[level] = [[(t, e.logprob) for step in o.outputs[0].logprobs for t, e in sorted(step.items())]
                           for o in outputs]
        assert all(got == seen[levels[0]] for got in seen.values()), name

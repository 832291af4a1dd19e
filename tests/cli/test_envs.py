"""The environment variables' declarations (kubeinfer/engine/envs.py, kubeinfer/common/envs.py): the README's table
is the generated one, a bad value of each validated variable is refused with its name and what it accepts, and
an unset or empty variable means what its reader took it to mean before the declarations."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kubeinfer.common import engine_key
from kubeinfer.common.envs import EnvVarError
from kubeinfer.engine import envs

README = Path(__file__).parents[2] / "README.md"
TABLE = re.compile(r"<!-- envs table: begin -->\n(.*?)<!-- envs table: end -->", re.S)

BAD = [  # (variable, a value it refuses, what the message says it accepts)
    (envs.QUANT_KERNEL, "cpu_int3", "one of triton, cpu_int4"),
    (envs.W8A8_KERNEL, "int4", "int8_vnni, int_mm or fake_quant"),
    (envs.W8A8_KERNEL, "", "int8_vnni, int_mm or fake_quant"),
    (envs.CPU_NATIVE_LAYERS, "yes", "0 or 1"),
    (envs.CPU_FUSED_LAYERS, "2", "0 or 1"),
    (envs.CPU_SHARE_CORES, "on", "auto, 0 or 1"),
    (envs.CPU_OPENBLAS_MAX_CONTEXT, "4k", "an integer"),
    (envs.CPU_NATIVE_THREADS, "0", "a positive integer"),
    (envs.CPU_NATIVE_THREADS, "-2", "a positive integer"),
    (envs.CPU_NATIVE_SPIN_US, "fast", "an integer"),
    (envs.CPU_NATIVE_SANITIZE, "thread", "one of address"),
]


def test_the_readme_table_is_the_generated_one():
    found = TABLE.search(README.read_text())
    assert found, "README.md lost its generated table of environment variables"
    assert found.group(1) == envs.markdown_table(), "regenerate it: python -m kubeinfer.engine.envs --markdown"


def test_the_markdown_entry_point_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "kubeinfer.engine.envs", "--markdown"], check=True,
                         capture_output=True, text=True).stdout
    assert out == envs.markdown_table()


def test_each_variable_is_declared_once():
    names = [var.name for var in envs.ALL]
    assert len(names) == len(set(names))
    assert all(var.doc and "\n" not in var.doc for var in envs.ALL)


@pytest.mark.parametrize(("var", "value", "accepts"), BAD, ids=[f"{v.name}={x!r}" for v, x, _ in BAD])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, var, value, accepts):
    monkeypatch.setenv(var.name, value)
    with pytest.raises(EnvVarError, match=f"^{var.name} must be {re.escape(accepts)}.*; got {re.escape(repr(value))}$"):
        var.get()


UNSET_OR_EMPTY = [  # (variable, value when unset, value when set empty)
    (envs.QUANT_KERNEL, None, None),
    (envs.W8A8_KERNEL, "int8_vnni", EnvVarError),
    (envs.CPU_NATIVE_LAYERS, True, EnvVarError),
    (envs.CPU_FUSED_LAYERS, True, EnvVarError),
    (envs.CPU_SHARE_CORES, "auto", EnvVarError),
    (envs.CPU_OPENBLAS, True, True),
    (envs.CPU_OPENBLAS_MAX_CONTEXT, 4096, EnvVarError),
    (envs.CPU_NATIVE_THREADS, None, None),
    (envs.CPU_NATIVE_SPIN_US, 50, EnvVarError),
    (envs.CPU_NATIVE_PORTABLE, False, False),
    (envs.CPU_NATIVE_SANITIZE, None, None),
    (envs.LOG_LEVEL, "INFO", ""),
    (envs.TERMINATION_LOG, None, None),
    (envs.ALLOWED_LORA_DIRS, [], []),
]


@pytest.mark.parametrize(("var", "unset", "empty"), UNSET_OR_EMPTY, ids=[v.name for v, _, _ in UNSET_OR_EMPTY])
def test_unset_and_empty_mean_what_they_meant(monkeypatch, var, unset, empty):
    monkeypatch.delenv(var.name, raising=False)
    assert var.get() == unset
    monkeypatch.setenv(var.name, "")
    if empty is EnvVarError:
        with pytest.raises(EnvVarError, match=var.name):
            var.get()
    else:
        assert var.get() == empty


def test_values_are_read_at_each_call(monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_OPENBLAS", "0")
    assert envs.CPU_OPENBLAS.get() is False
    monkeypatch.setenv("KUBEINFER_CPU_OPENBLAS", "1")
    assert envs.CPU_OPENBLAS.get() is True
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_PORTABLE", "yes")
    assert envs.CPU_NATIVE_PORTABLE.get() is True
    monkeypatch.setenv("KUBEINFER_ALLOWED_LORA_DIRS", " /a  /b ")
    assert envs.ALLOWED_LORA_DIRS.get() == ["/a", "/b"]


def test_the_cache_dir_defaults_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBEINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.CACHE_DIR.get() == str(tmp_path / ".cache" / "kubeinfer")
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", "/cache")
    assert envs.CACHE_DIR.get() == "/cache"


def test_the_engine_key_is_the_first_set_of_its_names(monkeypatch):
    monkeypatch.setenv("KUBEINFER_API_KEY", "")
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert engine_key.engine_key_from_env() == "from-vllm"
    monkeypatch.setenv("KUBEINFER_API_KEY", "ours")
    assert engine_key.engine_key_from_env() == "ours"
    monkeypatch.delenv("KUBEINFER_API_KEY")
    monkeypatch.delenv("VLLM_API_KEY")
    assert engine_key.engine_key_from_env() is None
    monkeypatch.setenv("KUBEINFER_ENGINE_API_KEY", "")
    assert engine_key.gateway_key_from_env() is None

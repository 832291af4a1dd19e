"""The alert rules against a real Prometheus toolchain (Debian's `prometheus` package, its `promtool`):
`promtool check rules` on the rule file and the chart's copy, and `promtool test rules` with one unit
test per alert (tests/prometheus/alerts/ALERT.test.yaml): each stays quiet before its `for` and on
healthy series, then fires with the labels and annotations written there."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "manifests" / "alerts" / "kubeinfer-rules.yaml"
UNIT_TESTS = ROOT / "tests" / "prometheus" / "alerts"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian/Ubuntu: apt-get install "
                                                          "prometheus); the alert rules are not checked by Prometheus")


def alerts() -> list[str]:
    document = yaml.safe_load(RULES.read_text())
    return [rule["alert"] for group in document["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("path", [RULES, ROOT / "charts" / "kubeinfer" / "files" / "kubeinfer-rules.yaml"],
                         ids=["manifests", "chart"])
def test_promtool_checks_the_rules(path):
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout + result.stderr


def test_every_alert_has_a_unit_test():
    assert {p.name.removesuffix(".test.yaml") for p in UNIT_TESTS.glob("*.test.yaml")} == set(alerts())


@pytest.mark.parametrize("alert", alerts())
def test_the_alert_fires_on_its_synthetic_series(alert):
    result = promtool("test", "rules", f"{alert}.test.yaml", cwd=UNIT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests can fail: the engine-down and high-queue alerts with their thresholds inverted."""
    text = RULES.read_text()
    broken = text.replace('up{job="kubeinfer-engine"} == 0', 'up{job="kubeinfer-engine"} == 1').replace(
        "avg by (namespace, model_name) (vllm:num_requests_waiting) > 5",
        "avg by (namespace, model_name) (vllm:num_requests_waiting) > 50")
    assert broken != text
    rules = tmp_path / "manifests" / "alerts"
    rules.mkdir(parents=True)
    (rules / "kubeinfer-rules.yaml").write_text(broken)
    tests = tmp_path / "tests" / "prometheus" / "alerts"
    tests.mkdir(parents=True)
    for alert in ("KubeinferEngineDown", "KubeinferRequestQueueBuildingUp"):
        shutil.copy(UNIT_TESTS / f"{alert}.test.yaml", tests)
        result = promtool("test", "rules", f"{alert}.test.yaml", cwd=tests)
        assert result.returncode != 0, f"{alert}: the unit test passed on a broken rule"

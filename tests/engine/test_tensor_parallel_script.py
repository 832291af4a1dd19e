"""`LLM(model=d, tensor_parallel_size=2)` in a plain script, as most users write one: no
`if __name__ == "__main__":` guard (issue #46, defect 14). The ranks are forked where that is safe, so the
script runs; where they must be spawned, an unguarded script is refused at once with what to change, instead
of every rank re-running it and the group waiting out its timeout."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kubeinfer.dev.testing.random_model import build_random_model

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_random_model(tmp_path_factory.mktemp("tp_script") / "model", "llama", num_kv_heads=1,
                                  tokenizer=False, seed=46))


def run_script(tmp_path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "KUBEINFER_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


GENERATE = """
    from kubeinfer.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(model={model!r}, tensor_parallel_size=2, num_kv_blocks=16)
    two = llm.generate([{{"prompt_token_ids": {prompt}}}], params)[0].outputs[0].token_ids
    llm.shutdown()
    one = LLM(model={model!r}, num_kv_blocks=16).generate([{{"prompt_token_ids": {prompt}}}], params)
    print("TOKENS", list(two), list(one[0].outputs[0].token_ids))
"""


def test_a_plain_script_without_a_main_guard_runs_two_ranks(tmp_path, model_dir):
    done = run_script(tmp_path, GENERATE.format(model=model_dir, prompt=PROMPT))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS"))
    two, one = line[len("TOKENS "):].split("] [")
    assert two + "]" == "[" + one and len(one.split(",")) == 6  # two ranks give the one-rank tokens
    assert "bootstrapping phase" not in done.stderr


FORCE_SPAWN = """
    import kubeinfer.engine.distributed.launch as launch
    launch.start_method = lambda: ("spawn", "forced by the test")
"""


def test_where_ranks_must_be_spawned_an_unguarded_script_is_told_about_the_guard(tmp_path, model_dir):
    done = run_script(tmp_path, FORCE_SPAWN + GENERATE.format(model=model_dir, prompt=PROMPT), timeout=60)
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "forced by the test" in done.stderr
    assert "script.py:" in done.stderr  # the line to move
    assert "bootstrapping phase" not in done.stderr and "DistStoreError" not in done.stderr


@pytest.mark.slow
def test_a_guarded_script_still_spawns_its_ranks(tmp_path, model_dir):
    generate = textwrap.indent(GENERATE.format(model=model_dir, prompt=PROMPT), "    ")
    body = FORCE_SPAWN + "\n    def main():" + generate + '\n    if __name__ == "__main__":\n        main()\n'
    done = run_script(tmp_path, body)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS" in done.stdout

"""LoRA through the HTTP API: `model: ADAPTER` runs the adapter (token-for-token equal to transformers +
PEFT), adapters load and unload at run time, and bad loads are refused with OpenAI-shaped errors."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from lora_helpers import MAX_TOKENS, PROMPTS
from server_harness import RunningServer

# return_token_ids (vLLM's extension) gives the completion's token ids: the tiny model has no tokenizer.
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def adapter_root(lora_adapters, tmp_path_factory):
    """The directory runtime loads are confined to, holding copies of the test adapters."""
    root = tmp_path_factory.mktemp("allowed_adapters")
    for request, _ in lora_adapters.values():
        shutil.copytree(request.lora_path, root / request.lora_name)
    return root


@pytest.fixture(scope="module")
def server(lora_base_dir, lora_adapters, adapter_root):
    # One device slot for three adapters: mixed traffic makes the pool swap.
    with RunningServer(lora_base_dir, name="base", enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4,
                       lora_modules=[lora_adapters["attn"][0]], lora_dirs=[adapter_root]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def unload(server, name: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_models_lists_base_and_adapters(client, lora_adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "attn"}
    assert models["attn"].parent == "base" and models["attn"].root == lora_adapters["attn"][0].lora_path
    assert models["base"].parent is None


def test_adapter_requests_match_peft(server, client, lora_adapters, lora_base_reference, adapter_root):
    assert load(server, "mlp", adapter_root / "mlp").status_code == 200
    jobs = [(name, p) for p in range(len(PROMPTS)) for name in ("base", "attn", "mlp")]

    def run(job):
        name, p = job
        response = client.completions.create(model=name, prompt=PROMPTS[p], **GREEDY)
        assert response.model == name and response.usage.completion_tokens == MAX_TOKENS
        assert response.choices[0].prompt_token_ids == PROMPTS[p]
        return response.choices[0].token_ids

    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: base and both adapters share batches
        got = list(pool.map(run, jobs))
    want = [lora_base_reference[p] if name == "base" else lora_adapters[name][1][p] for name, p in jobs]
    assert got == want
    assert "mlp" in {m.id for m in client.models.list().data}


def test_lora_metrics(server):
    info = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="1"' in info[0] and 'running_lora_adapters=""' in info[0]


def test_bad_loads_are_refused(server, adapter_root, lora_adapters, tmp_path):
    outside = shutil.copytree(lora_adapters["all"][0].lora_path, tmp_path / "outside")
    cases = [
        (load(server, "x", outside), 400, "outside the allowed adapter directories"),
        (load(server, "x", adapter_root / ".." / outside.name), 400, "outside the allowed adapter directories"),
        (load(server, "x", adapter_root / "missing"), 400, "does not exist"),
        (load(server, "attn", adapter_root / "attn"), 400, "already been loaded"),
        (load(server, "base", adapter_root / "attn"), 400, "already been loaded"),
        (httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path"),
        (unload(server, "never-loaded"), 404, "cannot be found"),
    ]
    broken = shutil.copytree(adapter_root / "all", adapter_root / "broken")
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    cases.append((load(server, "broken", broken), 400, "DoRA"))
    for response, status, message in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == status
    assert {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]} >= {"base", "attn"}
    assert "broken" not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}


def test_unload_then_model_is_unknown(server, client, adapter_root):
    assert load(server, "all", adapter_root / "all").status_code == 200
    client.completions.create(model="all", prompt=PROMPTS[0], **GREEDY)
    response = unload(server, "all")
    assert response.status_code == 200 and "removed" in response.text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="all", prompt=PROMPTS[0], **GREEDY)
    assert "all" not in {m.id for m in client.models.list().data}
    assert load(server, "all", adapter_root / "all").status_code == 200  # and it can come back


def test_lora_routes_need_lora_enabled(llama_dir):
    with RunningServer(llama_dir, name="plain") as plain:
        response = load(plain, "x", "/tmp")
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0).completions.create(
                model="attn", prompt="hi", max_tokens=2)



def test_serve_flags_for_lora_modules(lora_base_dir, lora_adapters, tmp_path):
    import argparse

    from kubeinfer.engine.entrypoints.serve import add_serve_arguments, build_state

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    attn, mlp = lora_adapters["attn"][0].lora_path, lora_adapters["mlp"][0].lora_path
    args = parser.parse_args([str(lora_base_dir), "--lora-modules", f"attn={attn}", json.dumps({"name": "mlp", "path": mlp}),
                              "--max-loras", "2", "--max-lora-rank", "8"])
    state = build_state(args)
    assert [r.lora_name for r in state.engine.list_loras()] == ["attn", "mlp"] and state.engine.config.enable_lora
    for bad, message in [([f"attn={attn}", f"attn={mlp}"], "unique"), (["attn"], "NAME=PATH"),
                         ([f"gone={tmp_path}"], "gone=.*no adapter_config.json"),
                         ([f"big={lora_adapters['mlp'][0].lora_path}", "--max-lora-rank", "4"], "--max-lora-rank 8")]:
        with pytest.raises(SystemExit, match=message):
            build_state(parser.parse_args([str(lora_base_dir), "--lora-modules", *bad]))


async def test_placement_file_drives_loaded_adapters(lora_base_dir, lora_adapters, adapter_root, tmp_path):
    """The operator's placement annotation, projected into a file, decides which catalog adapters are loaded."""
    from kubeinfer.engine.lora.placement import PlacementWatcher

    placement = tmp_path / "adapters"
    with RunningServer(lora_base_dir, name="base", enable_lora=True, max_loras=2, max_lora_rank=8,
                       lora_modules=[lora_adapters["attn"][0]]) as running:
        watcher = PlacementWatcher(running.state, placement, adapter_root)

        async def served_after(text: str) -> set[str]:
            placement.write_text(text)
            await watcher.sync()
            async with httpx.AsyncClient() as http:
                return {m["id"] for m in (await http.get(running.url + "/v1/models")).json()["data"]}

        assert await served_after("") == {"base", "attn"}
        assert await served_after("mlp,all") == {"base", "attn", "mlp", "all"}
        assert await served_after(" all \n") == {"base", "attn", "all"}
        assert await served_after("all,missing") == {"base", "attn", "all"}  # a bad name is logged, not fatal
        assert "missing" in watcher.failed
        assert await served_after("attn") == {"base", "attn"}  # --lora-modules adapters are not the watcher's
        assert await served_after("") == {"base", "attn"}
        placement.unlink()
        assert watcher.wanted() == []  # no annotation projected yet
        assert await served_after("mlp") == {"base", "attn", "mlp"}
        async with httpx.AsyncClient() as http:
            body = {"model": "mlp", "prompt": PROMPTS[0], "return_token_ids": True, **GREEDY["extra_body"],
                    "max_tokens": MAX_TOKENS, "temperature": 0}
            response = await http.post(running.url + "/v1/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["token_ids"] == lora_adapters["mlp"][1][0]

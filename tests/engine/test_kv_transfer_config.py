"""--kv-transfer-config / --kv-offloading-size: vLLM's keys parsed, bad configs a clear error before the model
loads, connectors found by name (an unknown one names those served)."""
import pytest

from kubeinfer.engine.kv_transfer import KVTransferConfig, connector_factory, resolve_kv_transfer, served_connectors


def test_vllm_keys_parse_from_json_and_dict():
    text = ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail", '
            '"kv_connector_extra_config": {"cpu_bytes_to_use": 1048576}}')
    config = KVTransferConfig.parse(text)
    assert config == KVTransferConfig("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": 1048576}, "fail")
    assert KVTransferConfig.parse({"kv_connector": "OffloadingConnector"}).kv_load_failure_policy == "recompute"
    assert KVTransferConfig.parse(None) is None and resolve_kv_transfer(None, None, None) is None


def test_offloading_shorthand_is_vllms_offloading_connector():
    config = resolve_kv_transfer(None, 2, "native")
    assert config.kv_connector == "OffloadingConnector" and config.kv_role == "kv_both"
    assert config.kv_connector_extra_config == {"cpu_bytes_to_use": 2 << 30}
    assert resolve_kv_transfer(None, 0.5, None).kv_connector_extra_config == {"cpu_bytes_to_use": 1 << 29}


@pytest.mark.parametrize("value, size, backend, message", [
    ("{not json", None, None, "not valid JSON"),
    ("[1]", None, None, "JSON object"),
    ({"kv_role": "kv_both"}, None, None, "kv_connector"),
    ({"kv_connector": "OffloadingConnector", "kv_buffer_sise": 1}, None, None, "unknown or unsupported key"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "both"}, None, None, "kv_role must be one of"),
    ({"kv_connector": "OffloadingConnector", "kv_load_failure_policy": "retry"}, None, None, "kv_load_failure_policy"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": [1]}, None, None, "must be a JSON object"),
    ({"kv_connector": "OffloadingConnector"}, 1, None, "not both"),
    (None, 1, "lmcache", "not served; served: ['native']"),
    (None, None, "native", "needs --kv-offloading-size"),
    (None, -1, None, "positive number of GiB"),
])
def test_bad_configs_say_what_is_wrong(value, size, backend, message):
    with pytest.raises(ValueError) as error:
        resolve_kv_transfer(value, size, backend)
    assert message in str(error.value)


def test_unknown_connector_names_the_served_ones():
    assert "OffloadingConnector" in served_connectors()
    with pytest.raises(ValueError) as error:
        connector_factory("LMCacheConnectorV1")
    assert "unknown kv_connector 'LMCacheConnectorV1'" in str(error.value)
    assert "OffloadingConnector" in str(error.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_transfer_config": {"kv_connector": "NixlConnector"}}, "served: ['OffloadingConnector']"),
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"}, "not served"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"cpu_bytes_to_use": 10}}}, "smaller than one KV block"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 4, "cpu_bytes_to_use": 1}}},
     "exactly one of"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 4, "block_size": 64}}},
     "must equal the engine's --block-size"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blok": 4}}}, "unknown kv_connector_extra_config"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "drop --no-enable-prefix-caching"),
])
def test_engine_refuses_bad_tier_configs_at_start(llama_dir, kwargs, message):
    from kubeinfer.engine import LLM

    with pytest.raises(ValueError) as error:
        LLM(llama_dir, block_size=4, num_kv_blocks=16, **kwargs)
    assert message in str(error.value)


def test_serve_flags_reach_the_engine_config():
    from kubeinfer.engine.entrypoints.serve import engine_config
    from parallel_helpers import serve_parser

    text = '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 8}}'
    config = engine_config(serve_parser().parse_args(["model", "--kv-transfer-config", text]), [])
    assert config.kv_transfer_config == text and config.kv_offloading_size is None
    config = engine_config(serve_parser().parse_args(["model", "--kv-offloading-size", "2.5",
                                                      "--kv-offloading-backend", "native"]), [])
    assert (config.kv_offloading_size, config.kv_offloading_backend) == (2.5, "native")
    assert resolve_kv_transfer(None, config.kv_offloading_size, config.kv_offloading_backend) is not None

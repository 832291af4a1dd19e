"""Fuzz the server from its own OpenAPI document (schemathesis): no input may cause a 5xx or a crash."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_harness import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    # A short context keeps generated max_tokens values cheap to serve.
    with RunningServer(llama_dir, name="tiny", max_model_len=64) as running:
        yield running


def test_no_server_errors(fuzz_server):
    # Driven through hypothesis directly: schemathesis' pytest plugin does not load under this pytest.
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path == "/v1/completions" for op in operations)
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            response = case.call()
            assert response.status_code < 500, (operation.path, case.body, response.text)
            assert httpx.get(fuzz_server.url + "/health").status_code == 200  # still serving

        no_5xx()

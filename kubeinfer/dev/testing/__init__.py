"""What tests, benchmarks and demos build for themselves: tiny random-init model directories (there is
no model hub here). Not part of serving: nothing in the engine imports it."""

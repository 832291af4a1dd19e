"""The engine's gRPC API: engine.proto and the stubs generated from it (`make proto`)."""

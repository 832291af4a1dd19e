"""What two parts of the product share: the HTTP guard and server settings (engine and gateway), gRPC health
(engine and gateway's ext_proc), the KV-event CURVE keys (engine publishes, gateway subscribes) and the names of
the engine key's environment variables (engine, gateway and operator). It imports none of the parts."""

"""A grpc.aio server that also serves the standard gRPC health service (grpc.health.v1), shared by the
engine's gRPC API and the gateway's Envoy ext_proc server: Kubernetes gRPC probes and load balancers
read it, and draining turns it NOT_SERVING before the server stops."""
from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


class HealthCheckedServer:
    def __init__(self, server: grpc.aio.Server, health_servicer, port: int, service_names: tuple[str, ...]) -> None:
        self.server, self.health, self.port, self.service_names = server, health_servicer, port, service_names

    @classmethod
    async def start(cls, add_servicers: Callable[[grpc.aio.Server], None], service_names: str | tuple[str, ...],
                    host: str, port: int) -> HealthCheckedServer:
        """Serve what `add_servicers` registers, plus health, on host:port (port 0: a free one, see .port).
        Health answers for the server as a whole ("") and for each of `service_names`."""
        service_names = (service_names,) if isinstance(service_names, str) else tuple(service_names)
        server = grpc.aio.server()
        add_servicers(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        bound = server.add_insecure_port(f"[::]:{port}" if host in ("0.0.0.0", "::") else f"{host}:{port}")
        if not bound:
            raise OSError(f"cannot listen for gRPC ({service_names[0]}) on {host}:{port}")
        await server.start()
        started = cls(server, health_servicer, bound, service_names)
        await started._set(health_pb2.HealthCheckResponse.SERVING)
        return started

    async def _set(self, status) -> None:
        for service in ("", *self.service_names):
            await self.health.set(service, status)

    async def start_draining(self) -> None:
        """Report NOT_SERVING so that load balancers stop sending new calls; in-flight calls go on."""
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = 1) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

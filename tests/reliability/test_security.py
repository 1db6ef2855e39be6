"""Gateway security: --api-key (UNAUTHENTICATED without the bearer token; health stays open for
probes) and --tls-cert/--tls-key (TLS only); plus random protobuf bytes at Generate never crash it."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.bench.reliability import GENERATE
from services.config import Addresses, GatewayConfig
from services.gateway.client import build_request
from services.gateway.pb import generation_pb2 as pb
from services.gateway.pb import generation_pb2_grpc as pb_grpc
from services.gateway.server import Gateway
from tests.test_gateway import FakePipeline

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    fake = FakePipeline(str(tmp_path_factory.mktemp("keyed")), api_key="s3cret")
    yield fake
    fake.close()


def test_api_key_is_required(keyed):
    stub = keyed.client.stub
    request = build_request("Once upon a time", max_tokens=2)
    for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=5, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfo(pb.ModelInfoRequest(), timeout=5, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert keyed.client.health() == "SERVING"  # probes carry no secret
    token = [("authorization", "Bearer s3cret")]
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=5, metadata=token).name
    assert keyed.gateway.streams == {}


def test_tls_only(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True, timeout=30)
    config = GatewayConfig(port=0, tls_cert=str(cert), tls_key=str(key))

    async def scenario() -> None:
        gateway = Gateway(config, Addresses.under(str(tmp_path)))
        target = f"localhost:{await gateway.start()}"
        try:
            creds = grpc.ssl_channel_credentials(cert.read_bytes())
            async with grpc.aio.secure_channel(target, creds) as channel:  # the handshake works
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert (await check).status == health_pb2.HealthCheckResponse.NOT_SERVING  # no engine here
            async with grpc.aio.insecure_channel(target) as channel:  # plaintext is refused
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await gateway.stop(0)

    uvloop.run(scenario())


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    fake = FakePipeline(str(tmp_path_factory.mktemp("fuzz")))
    yield fake
    fake.close()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=512), st.builds(
    lambda raw, at, junk: raw[:at] + junk + raw[at:],
    st.sampled_from([build_request("Once upon a time", max_tokens=2).SerializeToString(),
                     build_request([1, 2, 3], stop=["a"]).SerializeToString()]),
    st.integers(0, 40), st.binary(min_size=1, max_size=16))))
def test_random_protobuf_bytes_never_crash_the_gateway(fake, data):
    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(fake.target) as channel:
            generate = channel.unary_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)
            try:
                async for _ in generate(data, timeout=0.2):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    code = asyncio.run(call())
    # Parsed requests reach the (fake) tokenizer and wait out the deadline (or reuse a random
    # request_id still reserved); the rest are rejected. Never UNKNOWN or INTERNAL.
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.ALREADY_EXISTS), code

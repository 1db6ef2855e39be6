"""Gateway security: --api-key (UNAUTHENTICATED without the bearer token; health stays open for
probes; the clients send the key) and --tls-cert/--tls-key (TLS only), on the gateway alone and under
`pipeserve up`; plus random protobuf bytes at Generate never crash it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.bench.reliability import GENERATE
from pipeserve.config import Addresses, GatewayConfig
from pipeserve.gateway.client import AsyncClient, Client, build_request
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.gateway.pb import generation_pb2_grpc as pb_grpc
from pipeserve.gateway.server import Gateway
from pipeserve.local_cluster import ROOT
from tests.reliability.conftest import start
from tests.test_gateway import FakePipeline

pytestmark = [pytest.mark.serial, pytest.mark.timeout(60)]


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
    assert keyed.gateway.core.streams == {}


def test_clients_send_the_api_key(keyed):
    with Client(keyed.target, api_key="s3cret") as client:  # over plaintext: per-call metadata
        assert client.model_info(timeout=5).name == "fake"
        call = client.stream("Once upon a time", request_id="k1", max_tokens=2, timeout=5)
        assert keyed.next_request().rid == "k1"  # past the token check, at the tokenizer
        call.cancel()
        assert client.abort("no-such-id") is False
    with Client(keyed.target, api_key="wrong") as client, pytest.raises(grpc.RpcError) as info:
        client.model_info(timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def scenario() -> None:
        async with AsyncClient(keyed.target, api_key="s3cret") as client:
            assert (await client.model_info(timeout=5)).name == "fake"
            assert await client.abort("no-such-id") is False

    asyncio.run(scenario())
    keyed.wait(lambda: not keyed.gateway.core.streams)


def test_tls_only(tmp_path, certificate):
    cert, key = certificate
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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_serves_tls_and_checks_the_api_key(tmp_path, certificate):
    """`pipeserve up --tls-cert --tls-key --api-key`: the launcher's own health check speaks TLS (it
    logs "serving" only once SERVING), a TLS client with the token is served, one without is refused,
    plaintext is refused, and `pipeserve generate` reaches it with its TLS and key flags."""
    cert, key = certificate
    security = {"tls_root_cert": str(cert), "tls_server_name": "localhost", "api_key": "s3cret"}
    pipe = start(tmp_path / "up.log", "--tls-cert", str(cert), "--tls-key", str(key), "--api-key", "s3cret",
                 "--startup-timeout", "60", security=security)
    try:
        launcher_ready = "pipeserve.up INFO serving"
        pipe.wait(lambda: launcher_ready in pipe.log_path.read_text(), 30, "the launcher's SERVING")
        assert pipe.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3
        no_token = {k: v for k, v in security.items() if k != "api_key"}
        with Client(pipe.target, **no_token) as client, pytest.raises(grpc.RpcError) as info:
            client.generate("Once upon a time", max_tokens=3, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(pipe.target, api_key="s3cret") as client:  # plaintext
            assert client.health(timeout=5) == "UNREACHABLE"
        out = subprocess.run(
            [sys.executable, "-m", "pipeserve.cli", "generate", "Once upon a time", "--target", pipe.target,
             "--tls-root-cert", str(cert), "--tls-server-name", "localhost", "--max-tokens", "4",
             "--temperature", "0"], env={**os.environ, "PIPESERVE_API_KEY": "s3cret"}, cwd=ROOT,
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "completion_tokens=4" in out.stderr, out.stderr
        pipe.wait_clean()
    finally:
        pipe.stop()


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

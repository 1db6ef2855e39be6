"""Structured outputs over gRPC: the GenerateRequest `constraint` oneof reaches the pipeline as
SamplingParams; malformed constraints are refused by the gateway, constraints that do not compile
by the engine's compilation, both with INVALID_ARGUMENT naming what is wrong, before any token, and
the server keeps serving."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from pipeserve.gateway.client import Client, build_request
from pipeserve.gateway.pb import generation_pb2 as pb
from pipeserve.local_cluster import LocalCluster
from pipeserve.sampling_params import SamplingParams
from tests.test_gateway import FakePipeline, rpc_error

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["a", "b"]}},
    "required": ["n", "s"],
}


@pytest.fixture
def fake(tmp_path):
    pipeline = FakePipeline(str(tmp_path))
    yield pipeline
    pipeline.close()


def test_build_request_sets_only_the_given_constraint():
    assert build_request("x", json_object=False).WhichOneof("constraint") is None
    assert build_request("x", params=SamplingParams()).WhichOneof("constraint") is None
    request = build_request("x", json_schema=SCHEMA)
    assert request.WhichOneof("constraint") == "json_schema" and json.loads(request.json_schema) == SCHEMA
    request = build_request("x", params=SamplingParams(choice=["a", "b"]))
    assert request.WhichOneof("constraint") == "choice" and list(request.choice.choices) == ["a", "b"]
    assert build_request("x", choice=[]).WhichOneof("constraint") == "choice"  # sent, then refused


@pytest.mark.parametrize(
    "constraint",
    [
        dict(json_schema=SCHEMA),
        dict(json_object=True),
        dict(regex="[0-9]+"),
        dict(choice=["left", "right"]),
        dict(grammar='root ::= "a" | "b"'),
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_constraint_reaches_the_pipeline(fake, constraint):
    call = fake.client.stream("Hello", request_id="r1", **constraint)
    req = fake.next_request()
    expected = SamplingParams(**constraint)
    assert req.sampling.constraint() == expected.constraint()
    fake.send([("r1", "a", [7], "stop")])
    assert [c.finish_reason for c in call] == ["stop"]


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(json_schema="{oops"), "json_schema is not valid JSON"),
        (dict(json_schema="[]"), "json_schema must be a JSON object"),
        (dict(regex="x", min_tokens=2), "cannot be combined"),
    ],
)
def test_malformed_constraints_are_refused_by_the_gateway(fake, request_kwargs, message):
    err = rpc_error(fake.client.stream("Hello", timeout=10, **request_kwargs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    assert fake.tokenize.poll(50) == 0  # nothing reached the pipeline


@pytest.mark.slow
def test_server_refuses_constraints_that_do_not_compile_and_keeps_serving(stories_dir, tmp_path):
    bad = [
        (
            dict(json_schema={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "json_schema is invalid",
        ),
        (dict(regex="(ab"), "regex is invalid"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(grammar='root ::= "a" |'), "grammar is invalid"),
    ]
    with (
        LocalCluster(tmp_path / "server.log", stories_dir, workers=1, startup=90) as cluster,
        Client(cluster.target) as client,
    ):
        for kwargs, message in bad:
            with pytest.raises(grpc.RpcError) as info:
                client.generate("Once upon a time", timeout=30, max_tokens=8, **kwargs)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert message in info.value.details()
        out = client.generate(
            "Once upon a time", timeout=60, max_tokens=64, temperature=1.0, seed=5, json_schema=SCHEMA
        )
        if out.finish_reason == "stop":
            value = json.loads(out.text)
            assert set(value) == {"n", "s"} and 0 <= value["n"] <= 9 and value["s"] in ("a", "b")
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")
        out = client.generate("Lily said", timeout=60, max_tokens=32, regex=r"[a-z]{2,6}!", temperature=1.0)
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,6}!", out.text)
        out = client.generate(
            "Lily said", timeout=60, max_tokens=16, temperature=0.0
        )  # free text still works
        assert out.completion_tokens > 0


def test_the_proto_declares_the_constraint_oneof():
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["constraint"]
    assert [f.name for f in oneof.fields] == ["json_schema", "json_object", "regex", "choice", "grammar"]


def test_generate_cli_takes_every_constraint():
    import argparse

    from pipeserve.gateway import client

    parser = argparse.ArgumentParser()
    client.add_arguments(parser)
    args = parser.parse_args(["hi", "--choice", "yes", "--choice", "no", "--json-object", "--regex", "a+"])
    assert (args.choice, args.json_object, args.regex, args.json_schema, args.grammar) == (
        ["yes", "no"], True, "a+", None, None)  # fmt: skip
    args = parser.parse_args(["hi", "--json-schema", json.dumps(SCHEMA)])
    given = {name: getattr(args, name) for name in ("json_schema", "choice", "regex")}
    request = build_request("hi", **given)
    assert request.WhichOneof("constraint") == "json_schema" and json.loads(request.json_schema) == SCHEMA

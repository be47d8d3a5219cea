"""Mutual TLS between services, by configuration (LAZYSERVE_TLS_CA / _CERT / _KEY): a worker
serving with it completes no handshake without a certificate signed by its CA, and the whole
path (gateway -> prefill worker -> KV stream -> decode worker) works with it."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from helpers import encode_transfer, random_ids

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from services.router.client import DecodeClient, PrefillClient, run_disaggregated
from shared.engine import OFF, PruneConfig, SamplingParams, generate
from shared.net import rpc
from shared.net.certs import INTERNAL_NAME, make_dev_certs
from shared.net.settings import InternalAuthSettings

LAZYSERVE = os.path.join(os.path.dirname(sys.executable), "lazyserve")
CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))


def _tls_settings(paths, **extra) -> dict:
    return {"tls_ca": paths["ca"], "tls_cert": paths["cert"], "tls_key": paths["key"], **extra}


def test_a_worker_with_mutual_tls_refuses_peers_without_our_certificate(tiny_llama, decode_worker, tmp_path):
    ours = make_dev_certs(tmp_path / "ours", ["127.0.0.1"])
    theirs = make_dev_certs(tmp_path / "theirs", ["127.0.0.1"])
    worker, _ = decode_worker(tiny_llama, **_tls_settings(ours))
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 40), CONFIG, SamplingParams(max_new_tokens=3))

    def status_code(channel: grpc.Channel) -> grpc.StatusCode | None:
        with channel:
            try:
                pb_grpc.DecodeServiceStub(channel).Status(pb.StatusRequest(), timeout=5)
            except grpc.RpcError as error:
                return error.code()
        return None

    plaintext = grpc.insecure_channel(worker.address)
    no_client_cert = grpc.secure_channel(worker.address, grpc.ssl_channel_credentials(ours["ca"].read_bytes()))
    other_ca = InternalAuthSettings(**_tls_settings(theirs)).internal_auth()
    # Ours trusts the server but presents the other CA's client certificate.
    foreign_client = grpc.secure_channel(
        worker.address,
        grpc.ssl_channel_credentials(ours["ca"].read_bytes(), theirs["key"].read_bytes(), theirs["cert"].read_bytes()),
    )
    for name, channel in [
        ("plaintext", plaintext),
        ("no client certificate", no_client_cert),
        ("the other CA", other_ca.channel(worker.address)),
        ("a foreign client certificate", foreign_client),
    ]:
        assert status_code(channel) == grpc.StatusCode.UNAVAILABLE, name
    assert not rpc.check_health(worker.address)  # even probes need a certificate

    auth = InternalAuthSettings(**_tls_settings(ours)).internal_auth()
    assert rpc.check_health(worker.address, auth=auth)
    trusted = DecodeClient(worker.address, auth)
    assert trusted.stub.PushKV(iter(messages), timeout=10).num_frames > 0
    assert trusted.status().transfers_ready == 1
    trusted.close()


def test_the_whole_path_over_mutual_tls_with_a_fixed_server_name(
    tiny_llama, decode_worker, prefill_worker, gateway, tmp_path
):
    # The certificate names no address at all, as for Ray-placed actors: clients check the fixed name.
    paths = make_dev_certs(tmp_path, [INTERNAL_NAME])
    tls = _tls_settings(paths, tls_server_name=INTERNAL_NAME, internal_token="and-a-token")
    decode, _ = decode_worker(tiny_llama, **tls)
    prefill = prefill_worker(tiny_llama, **tls)
    ids = random_ids(tiny_llama, 200)
    params = SamplingParams(max_new_tokens=4)

    unchecked_name = InternalAuthSettings(**{**tls, "tls_server_name": None}).internal_auth()
    with pytest.raises(grpc.RpcError) as error:
        DecodeClient(decode.address, unchecked_name).status()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 is not in the certificate

    auth = InternalAuthSettings(**tls).internal_auth()
    result = run_disaggregated(
        PrefillClient(prefill.address, auth), DecodeClient(decode.address, auth), ids, OFF, params
    )
    assert result.tokens == generate(tiny_llama.engine, ids, OFF, params).tokens
    running = gateway(prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=100, **tls)
    reply = running.openai().completions.with_raw_response.create(model="tiny-llama", prompt=ids, max_tokens=3)
    assert reply.headers["x-lazyserve-route"] == "disaggregated"
    assert reply.parse().choices[0].text


def test_half_a_tls_configuration_is_refused_with_what_is_missing(tmp_path):
    paths = make_dev_certs(tmp_path)
    with pytest.raises(ValueError, match="missing tls_key"):
        InternalAuthSettings(tls_ca=paths["ca"], tls_cert=paths["cert"])


def test_lazyserve_certs_and_health_from_the_command_line(tiny_llama, decode_worker, tmp_path):
    out = subprocess.run(
        [LAZYSERVE, "certs", "--out", str(tmp_path), "--host", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    env = dict(part.split("=", 1) for part in out.split()[1:])  # "export A=... B=... C=..."
    assert set(env) == {"LAZYSERVE_TLS_CA", "LAZYSERVE_TLS_CERT", "LAZYSERVE_TLS_KEY"}
    assert oct(os.stat(env["LAZYSERVE_TLS_KEY"]).st_mode & 0o777) == "0o600"
    worker, _ = decode_worker(
        tiny_llama, tls_ca=env["LAZYSERVE_TLS_CA"], tls_cert=env["LAZYSERVE_TLS_CERT"], tls_key=env["LAZYSERVE_TLS_KEY"]
    )
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYSERVE_TLS_")}

    def probe(extra: dict) -> int:
        return subprocess.run(
            [LAZYSERVE, "health", worker.address], env={**plain_env, **extra}, capture_output=True, timeout=60
        ).returncode

    assert probe(env) == 0
    assert probe({}) == 1  # without the certificate the probe cannot connect either

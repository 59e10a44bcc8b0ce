"""TLS on the router's public APIs (router.tls): the config, the checks on its files, the gRPC
server with server-only TLS and with mutual TLS, the HTTPS OpenAI API, and the CLI's --tls-*
flags. The certificates are made here for each run (tests/factories.make_tls_files)."""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.deploy.cli import main as cli_main
from splitserve.deploy.client import ClientTls, GenerationClient
from splitserve.deploy.cluster_config import ClusterConfigError, dump_cluster_config, parse_cluster_config
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.server import start_grpc_server
from splitserve.router.tls import TlsConfig, load_tls
from tests.factories import ServedApis, TlsFiles, make_tls_files, served_apis

MODEL = "tiny-llama"
PROMPT = "The river runs"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pki"))


def _request() -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, text=PROMPT.encode(),
                              sampling=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))


def _generate(target: str, tls: ClientTls | None) -> list[int]:
    with GenerationClient(target, timeout_s=60, tls=tls) as client:
        return [t for r in client.stream(_request()) for t in r.token_ids]


def _grpc_failure(target: str, tls: ClientTls | None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        _generate(target, tls)
    return caught.value.code(), caught.value.details()


# ---- config -------------------------------------------------------------------------------

def _tls_yaml(**fields: object) -> str:
    return "model: m\nrouter:\n  tls: " + json.dumps(fields) + "\n"


def test_config_reads_a_tls_section(pki):
    assert parse_cluster_config("model: m\n").router.tls is None
    config = parse_cluster_config(_tls_yaml(cert_file=str(pki.server_cert), key_file=str(pki.server_key)))
    assert config.router.tls == TlsConfig(str(pki.server_cert), str(pki.server_key), None)
    assert not config.router.tls.requires_client_certificate
    mutual = parse_cluster_config(_tls_yaml(cert_file=str(pki.server_cert), key_file=str(pki.server_key),
                                            client_ca_file=str(pki.ca_cert)))
    assert mutual.router.tls.client_ca_file == str(pki.ca_cert)
    assert mutual.router.tls.requires_client_certificate
    assert parse_cluster_config(dump_cluster_config(mutual)) == mutual
    assert parse_cluster_config(dump_cluster_config(config)) == config


def test_config_errors_name_the_key(pki, tmp_path):
    cert, key, missing = str(pki.server_cert), str(pki.server_key), str(tmp_path / "missing.pem")
    cases = {
        _tls_yaml(cert_file=cert): "router.tls.key_file: required key is missing",
        _tls_yaml(key_file=key): "router.tls.cert_file: required key is missing",
        _tls_yaml(cert_file=missing, key_file=key): f"router.tls.cert_file: must name an existing file, got "
                                                    f"{missing!r}",
        _tls_yaml(cert_file=cert, key_file=""): "router.tls.key_file: must name an existing file, got ''",
        _tls_yaml(cert_file=cert, key_file=str(tmp_path)): f"router.tls.key_file: must name an existing file, "
                                                           f"got {str(tmp_path)!r}",
        _tls_yaml(cert_file=cert, key_file=key, client_ca_file=missing):
            f"router.tls.client_ca_file: must name an existing file, got {missing!r}",
        _tls_yaml(cert_file=cert, key_file=7): "router.tls.key_file: must be a string, got 7",
        _tls_yaml(cert_file=cert, key_file=key, ca_file=cert):
            "router.tls.ca_file: unknown key (known: cert_file, client_ca_file, key_file)",
        "model: m\nrouter: {tls: yes}\n": "router.tls: must be a mapping, got True",
    }
    for text, message in cases.items():
        with pytest.raises(ClusterConfigError) as caught:
            parse_cluster_config(text)
        assert str(caught.value) == message


def test_load_tls_checks_the_files_belong_together(pki):
    with pytest.raises(ValueError) as caught:
        load_tls(TlsConfig(str(pki.server_cert), str(pki.client_key)))
    assert str(caught.value).startswith(f"TLS: cert_file {str(pki.server_cert)!r} and key_file "
                                        f"{str(pki.client_key)!r} are not a PEM certificate chain and its private "
                                        "key: [X509: KEY_VALUES_MISMATCH]")
    with pytest.raises(ValueError) as caught:
        load_tls(TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.server_key)))
    assert str(caught.value).startswith(f"TLS: client_ca_file {str(pki.server_key)!r} holds no PEM CA certificate: ")
    loaded = load_tls(TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca_cert)))
    assert (loaded.certificate_chain, loaded.client_ca) == (pki.server_cert.read_bytes(), pki.ca_cert.read_bytes())


def test_serving_refuses_to_start_with_bad_tls_files(pki, tmp_path):
    """Before Ray or any worker starts."""
    import asyncio

    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config
    from splitserve.deploy.local import LocalCluster

    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate\n")
    config = apply_overrides(default_cluster_config("default"),
                             {"router.tls.cert_file": str(not_pem), "router.tls.key_file": str(pki.server_key)})
    with pytest.raises(ValueError, match=r"^TLS: cert_file .* are not a PEM certificate chain and its private key"):
        asyncio.run(LocalCluster(config).start())


# ---- server-only TLS ----------------------------------------------------------------------

class Served(ServedApis):
    plaintext_port: int = 0
    """A plaintext gRPC server over the same cluster: what TLS must not change."""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@pytest.fixture(scope="module")
def served(tiny_llama_dir, pki):
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key))
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, tls=tls) as served:
        cluster = served.cluster
        plaintext = served.loop.run(start_grpc_server(cluster.orchestrator, served.tokenizers, MODEL, port=0))
        served.plaintext_port = plaintext.port
        try:
            yield served
        finally:
            served.loop.run(plaintext.stop(None))


def test_tls_generates_what_plaintext_does(served, pki):
    plain = _generate(f"127.0.0.1:{served.plaintext_port}", None)
    assert len(plain) == MAX_TOKENS
    assert _generate(served.target, ClientTls(str(pki.ca_cert))) == plain
    assert _generate(f"localhost:{served.grpc_port}", ClientTls(str(pki.ca_cert))) == plain
    served.loop.run(served.cluster.wait_idle())


def test_plaintext_client_is_refused(served):
    code, _ = _grpc_failure(served.target, None)
    assert code == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_ca_is_refused(served, pki):
    code, details = _grpc_failure(served.target, ClientTls(str(pki.other_ca_cert)))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in details


def test_health_over_tls(served, pki):
    credentials = ClientTls(str(pki.ca_cert)).channel_credentials()
    with grpc.secure_channel(served.target, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitserve.v1.Generation"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def _https(port: int, context: ssl.SSLContext, method: str, path: str, body: dict | None = None
           ) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=context)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def test_https_openai_api_uses_the_same_certificate(served, pki):
    with GenerationClient(served.target, 60, tls=ClientTls(str(pki.ca_cert))) as client:
        grpc_text = "".join(r.text for r in client.stream(_request()))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, answer = _https(served.http_port, _client_context(pki.ca_cert), "POST", "/v1/completions", body)
    assert status == 200
    completion = json.loads(answer)
    assert (completion["choices"][0]["text"], completion["usage"]["completion_tokens"]) == (grpc_text, MAX_TOKENS)
    assert _https(served.http_port, _client_context(pki.ca_cert), "GET", "/health") == (200, b"")
    with pytest.raises(ssl.SSLCertVerificationError):
        _https(served.http_port, _client_context(pki.other_ca_cert), "GET", "/health")


def test_cli_tls_flags(served, pki, capsys):
    args = ["generate", "--target", served.target, "--max-tokens", "3", "--ignore-eos", PROMPT]
    assert cli_main([*args[:3], "--tls-ca", str(pki.ca_cert), *args[3:]]) == 0
    assert "completion_tokens=3" in capsys.readouterr().err
    assert cli_main(args) == 1
    assert "splitserve: error: UNAVAILABLE: " in capsys.readouterr().err
    assert cli_main([*args[:3], "--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert), *args[3:]]) == 2
    assert capsys.readouterr().err == ("splitserve: error: TLS: a client certificate needs its key: give both "
                                       "cert_file and key_file, or neither\n")


# ---- mutual TLS ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served_mutual(tiny_llama_dir, pki):
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca_cert))
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, tls=tls) as served:
        yield served


def test_mutual_tls_needs_a_certificate_signed_by_the_ca(served_mutual, pki):
    ca = str(pki.ca_cert)
    assert _grpc_failure(served_mutual.target, ClientTls(ca))[0] == grpc.StatusCode.UNAVAILABLE
    stranger = ClientTls(ca, str(pki.other_client_cert), str(pki.other_client_key))
    assert _grpc_failure(served_mutual.target, stranger)[0] == grpc.StatusCode.UNAVAILABLE
    assert len(_generate(served_mutual.target, ClientTls(ca, str(pki.client_cert), str(pki.client_key)))) == MAX_TOKENS
    served_mutual.loop.run(served_mutual.cluster.wait_idle())


def test_mutual_tls_on_https(served_mutual, pki):
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _https(served_mutual.http_port, _client_context(pki.ca_cert), "GET", "/health")
    context = _client_context(pki.ca_cert, pki.client_cert, pki.client_key)
    assert _https(served_mutual.http_port, context, "GET", "/health") == (200, b"")


def test_cli_mutual_tls(served_mutual, pki, capsys):
    args = ["generate", "--target", served_mutual.target, "--tls-ca", str(pki.ca_cert), "--max-tokens", "2",
            "--ignore-eos", PROMPT]
    assert cli_main([*args[:5], "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key), *args[5:]]) == 0
    assert "completion_tokens=2" in capsys.readouterr().err
    assert cli_main(args) == 1
    assert "splitserve: error: UNAVAILABLE: " in capsys.readouterr().err

"""Redis URLs with credentials and TLS: ``connect()`` against a ``redis-server`` that
requires a password, an ACL user, or TLS (certificates made here, never committed)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError

from cluster.runtime.redis_client import check_url, connect, redacted_url
from cluster.runtime.redis_server import RedisServer, TlsFiles
from cluster.wire.keys import Keys
from cluster.wire.protocol import Job
from cluster.wire.queue import JobQueue

USER = ("charserve", "s3cret p@ss:/word")  # needs percent-encoding in the URL


def _make_certs_cryptography(folder: Path) -> TlsFiles:
    """A self-signed CA and a server certificate for IP 127.0.0.1, with ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "charserve test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
    return files


def _make_certs_openssl(folder: Path) -> TlsFiles:
    """The same certificates with the ``openssl`` command."""
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    ca_ext = ["basicConstraints=critical,CA:TRUE,pathlen:0", "keyUsage=critical,keyCertSign"]
    run(
        *["req", "-x509", *ec, "-keyout", "ca.key", "-out", str(files.ca_cert), "-days", "1"],
        *["-subj", "/CN=charserve test CA", "-addext", ca_ext[0], "-addext", ca_ext[1]],
    )
    run("req", *ec, "-keyout", str(files.key), "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
        "extendedKeyUsage=serverAuth\n"
    )
    run(
        *["x509", "-req", "-in", "server.csr", "-CA", str(files.ca_cert), "-CAkey", "ca.key"],
        *["-CAcreateserial", "-days", "1", "-extfile", "server.ext", "-out", str(files.cert)],
    )
    return files


def make_certs(folder: Path) -> TlsFiles:
    """Test certificates in ``folder``: with ``cryptography`` when installed, else
    ``openssl``."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl is available")
        return _make_certs_openssl(folder)
    return _make_certs_cryptography(folder)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1, made for this run."""
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """A redis-server with an ACL user and the default user disabled."""
    with RedisServer(acl_user=USER) as server:
        yield server


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    """A redis-server with ``requirepass``."""
    with RedisServer(password="pw-only") as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    """A redis-server speaking only TLS, with an ACL user: the production shape."""
    with RedisServer(acl_user=USER, tls=tls_files) as server:
        yield server


@pytest.fixture
async def client(request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """``connect()`` to the server fixture named by the test's parameter."""
    server: RedisServer = request.getfixturevalue(request.param)
    redis = connect(server.url)
    yield redis
    await redis.aclose()


def job(job_id: str) -> Job:
    return Job(
        id=job_id,
        reply_to="inbox",
        model="m",
        prompt_token_ids=[1],
        max_tokens=1,
        sampling={},
        arrival_ms=1,
        deadline_ms=100,
    )


SERVERS = pytest.mark.parametrize(
    ("client", "server_name"),
    [("acl_server", "acl_server"), ("tls_server", "tls_server")],
    indirect=["client"],
)


@SERVERS
async def test_queue_round_trip(client: aioredis.Redis, server_name: str) -> None:
    """Lua-scripted enqueue/claim works for the ACL user, in clear and over TLS."""
    queue = JobQueue(client, Keys(f"sec-{server_name}"))
    assert await queue.enqueue(job("j1"))
    assert [j.id for j in (await queue.claim("w1", 10, lease_ms=1000)).jobs] == ["j1"]


@SERVERS
async def test_pubsub_and_blocking_pop(
    client: aioredis.Redis, server_name: str, request: pytest.FixtureRequest
) -> None:
    """Pub/sub and a ``blocking=True`` client authenticate (and encrypt) like the rest."""
    url = request.getfixturevalue(server_name).url
    pubsub = client.pubsub()
    blocking = connect(url, blocking=True)
    try:
        await pubsub.subscribe("sec-channel")
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
        assert await client.publish("sec-channel", b"hello") == 1
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert message is not None and message["data"] == b"hello"

        async def pop_one() -> object:
            return await blocking.blpop(["sec-list"], timeout=2)

        pop = asyncio.create_task(pop_one())
        await asyncio.sleep(0.05)
        await client.rpush("sec-list", b"item")
        assert await pop == (b"sec-list", b"item")
    finally:
        await pubsub.aclose()
        await blocking.aclose()


async def test_requirepass_url(password_server: RedisServer) -> None:
    """``redis://:PASSWORD@host`` authenticates against ``requirepass``."""
    assert password_server.url.startswith("redis://:pw-only@127.0.0.1:")
    redis = connect(password_server.url)
    try:
        await redis.set("sec-key", b"v")
        assert await redis.get("sec-key") == b"v"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("server_name", ["acl_server", "password_server", "tls_server"])
async def test_wrong_or_missing_password_is_an_authentication_error(
    server_name: str, request: pytest.FixtureRequest
) -> None:
    server: RedisServer = request.getfixturevalue(server_name)
    scheme, rest = server.url.split("://", 1)
    host = rest.split("@", 1)[1]
    user = "charserve" if server.acl_user else ""
    for url in (f"{scheme}://{user}:wrong@{host}", f"{scheme}://{host}"):
        redis = connect(url)
        try:
            with pytest.raises(AuthenticationError):
                await redis.ping()
        finally:
            await redis.aclose()


async def test_plain_client_fails_against_tls_port(tls_server: RedisServer) -> None:
    """A ``redis://`` client cannot talk to the TLS port: a connection error, not a hang."""
    url = tls_server.url.replace("rediss://", "redis://").split("?")[0]
    redis = connect(url + "?socket_timeout=2")
    try:
        with pytest.raises(ConnectionError) as caught:
            await redis.ping()
        assert not isinstance(caught.value, AuthenticationError)
    finally:
        await redis.aclose()


async def test_tls_without_the_ca_fails_verification(tls_server: RedisServer) -> None:
    """The server certificate is verified: without ``ssl_ca_certs`` the private CA is
    unknown and the handshake fails."""
    redis = connect(tls_server.url.split("?")[0])
    try:
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await redis.ping()
    finally:
        await redis.aclose()


def test_tls_server_url(tls_server: RedisServer, tls_files: TlsFiles) -> None:
    assert tls_server.url == (
        f"rediss://charserve:s3cret%20p%40ss%3A%2Fword@127.0.0.1:{tls_server.port}/0"
        f"?ssl_ca_certs={tls_files.ca_cert}"
    )


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("redis://127.0.0.1:1/0?ssl_ca_certs=/ca.pem", "needs TLS: use rediss://"),
        ("rediss://127.0.0.1:1/0?ssl_ca_cert=/ca.pem", "unknown Redis URL option 'ssl_ca_cert'"),
        ("http://127.0.0.1:1/0", "must start with redis://"),
    ],
)
def test_bad_urls_fail_at_connect(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        connect(url)


def test_good_url_options_pass() -> None:
    check_url(
        "rediss://u:p@127.0.0.1:1/0?ssl_ca_certs=/ca.pem&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
        "&ssl_cert_reqs=required&ssl_check_hostname=false&socket_timeout=3&client_name=gw"
    )
    check_url("redis://127.0.0.1:1?db=2&health_check_interval=10")


def test_redacted_url_hides_the_password() -> None:
    assert redacted_url("rediss://u:se%40cret@127.0.0.1:6380/0?ssl_ca_certs=/ca.pem") == (
        "rediss://u:***@127.0.0.1:6380/0?ssl_ca_certs=/ca.pem"
    )
    assert redacted_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redacted_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"


def test_a_server_that_fails_to_start_is_not_left_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never_ready(self: redis.Redis) -> bool:
        raise redis.ConnectionError("not yet")

    monkeypatch.setattr(redis.Redis, "ping", never_ready)
    server = RedisServer()
    with pytest.raises(TimeoutError, match="did not start"):
        server.start(timeout_s=0.3)
    assert server._proc is None  # stopped (SIGTERM, then SIGKILL), not orphaned
    server.stop()


def test_a_server_still_loading_its_data_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_ping = redis.Redis.ping

    def loading_then_ready(self: redis.Redis) -> bool:
        calls["n"] += 1
        if calls["n"] <= 30:  # about 0.6 s of LOADING: longer than the start timeout
            raise redis.BusyLoadingError("Redis is loading the dataset in memory")
        return bool(real_ping(self))

    monkeypatch.setattr(redis.Redis, "ping", loading_then_ready)
    server = RedisServer()
    try:
        server.start(timeout_s=0.2)
        assert calls["n"] > 30
    finally:
        server.stop()

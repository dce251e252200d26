"""Remote image URLs: off by default, allow-listed hosts only, every resolved address and every redirect hop
checked, size capped while streaming, one deadline. Fakes stand in for DNS and HTTP (the designed seams); one
real loopback server checks the production fetcher's pinning, Host header, cap and timeout."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from firsttoken.inputs.image import ImageInputError
from firsttoken.inputs.media import (
    FetchRequest,
    FetchResponse,
    MediaNetwork,
    PinnedHTTPFetcher,
    RemoteMedia,
    load_image_bytes,
    remote_media,
)
from tests.media_fakes import FakeFetcher, FakeResolver, redirect
from tests.media_fakes import ok as ok_body

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 100
MAX_BYTES = 1000


def ok(body: bytes = PNG) -> FetchResponse:
    return ok_body(body)


DNS = {
    "img.example.com": ["93.184.216.34"],
    "cdn.example.com": ["2606:4700::1111"],
    "loop.example.com": ["127.0.0.1"],
    "private.example.com": ["10.0.0.7"],
    "mixed.example.com": ["93.184.216.34", "192.168.1.10"],
    "meta.example.com": ["169.254.169.254"],
    "meta6.example.com": ["fd00:ec2::254"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
    "zero.example.com": ["0.0.0.0"],
    "multi.example.com": ["224.0.0.251"],
    "linklocal.example.com": ["fe80::1%eth0"],
    "not-listed.example.com": ["93.184.216.35"],
}
ALLOWED = "img.example.com,CDN.example.com,loop.example.com,private.example.com,mixed.example.com," \
          "meta.example.com,meta6.example.com,mapped.example.com,zero.example.com,multi.example.com," \
          "linklocal.example.com"


def load(url: str, routes: dict | None = None, **kw) -> tuple[bytes, FakeFetcher]:
    fetcher = FakeFetcher(routes or {})
    network = MediaNetwork(FakeResolver(DNS), fetcher, **kw)
    return load_image_bytes(url, None, MAX_BYTES, remote_media(ALLOWED, 5.0, network)), fetcher


def refused(url: str, routes: dict | None = None, **kw) -> tuple[ImageInputError, FakeFetcher]:
    fetcher = FakeFetcher(routes or {})
    network = MediaNetwork(FakeResolver(DNS), fetcher, **kw)
    with pytest.raises(ImageInputError) as info:
        load_image_bytes(url, None, MAX_BYTES, remote_media(ALLOWED, 5.0, network))
    assert url not in str(info.value) and "example" not in str(info.value)  # never echoes the URL
    return info.value, fetcher


def test_remote_urls_are_off_by_default_and_nothing_is_resolved() -> None:
    resolver = FakeResolver(DNS)
    for remote in (None, RemoteMedia(frozenset(), 5.0, network=MediaNetwork(resolver, FakeFetcher({})))):
        with pytest.raises(ImageInputError) as info:
            load_image_bytes("https://img.example.com/a.png", None, MAX_BYTES, remote)
        assert info.value.code == "media_not_allowed" and "disabled" in str(info.value)
    assert resolver.asked == []


def test_allowed_host_is_fetched_from_the_checked_address_naming_the_host() -> None:
    data, fetcher = load("https://IMG.example.com./a.png?v=2", {("img.example.com", "/a.png?v=2"): ok()})
    assert data == PNG
    (sent,) = fetcher.sent
    assert (sent.scheme, sent.host, sent.port, sent.ip, sent.max_bytes) == (
        "https", "img.example.com", 443, "93.184.216.34", MAX_BYTES)
    data, fetcher = load("http://cdn.example.com:8080/b.png", {("cdn.example.com", "/b.png"): ok()})
    assert data == PNG and fetcher.sent[0].port == 8080 and fetcher.sent[0].ip == "2606:4700::1111"


@pytest.mark.parametrize("host", ["loop", "private", "mixed", "meta", "meta6", "mapped", "zero", "multi", "linklocal"])
def test_allowed_host_resolving_to_an_internal_address_is_refused_before_any_connection(host: str) -> None:
    err, fetcher = refused(f"http://{host}.example.com/a.png", {(f"{host}.example.com", "/a.png"): ok()})
    assert err.code == "media_not_allowed" and "resolves to" in str(err)
    assert fetcher.sent == []


def test_hosts_outside_the_list_and_tricky_urls_are_refused_before_resolution() -> None:
    for url in ("https://not-listed.example.com/a.png", "https://img.example.com.evil.org/a.png",
                "https://img.example.com@not-listed.example.com/a.png", "http://93.184.216.34/a.png",
                "https://evil.org\\@img.example.com/a.png"):
        err, fetcher = refused(url)
        assert err.code == "media_not_allowed" and fetcher.sent == []


def test_every_redirect_hop_is_checked_again() -> None:
    hop = {("img.example.com", "/a.png"): redirect("https://cdn.example.com/b.png"),
           ("cdn.example.com", "/b.png"): redirect("/c.png"), ("cdn.example.com", "/c.png"): ok()}
    data, fetcher = load("https://img.example.com/a.png", hop)
    assert data == PNG and [r.target for r in fetcher.sent] == ["/a.png", "/b.png", "/c.png"]

    for location in ("http://meta.example.com/latest/meta-data/", "http://127.0.0.1:8000/v1/engine/stats",
                     "http://not-listed.example.com/x.png", "file:///etc/passwd", "gopher://img.example.com/"):
        err, fetcher = refused("https://img.example.com/a.png", {("img.example.com", "/a.png"): redirect(location)})
        assert err.code == "media_not_allowed" and len(fetcher.sent) == 1  # the forbidden hop is never sent


def test_redirect_loops_stop_after_the_limit() -> None:
    err, fetcher = refused("https://img.example.com/a.png",
                           {("img.example.com", "/a.png"): redirect("https://img.example.com/a.png")})
    assert "more than 3" in str(err) and len(fetcher.sent) == 4


def test_size_cap_status_and_network_errors_are_clear_400s() -> None:
    err, _ = refused("https://img.example.com/big", {("img.example.com", "/big"): ok(b"x" * (MAX_BYTES + 1))})
    assert err.code == "image_too_large" and str(MAX_BYTES) in str(err)
    err, _ = refused("https://img.example.com/declared",
                     {("img.example.com", "/declared"): FetchResponse(200, None, 10**9, b"")})
    assert err.code == "image_too_large"
    err, _ = refused("https://img.example.com/missing")
    assert err.code == "invalid_image" and "HTTP 404" in str(err)

    class Failing:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def fetch(self, request: FetchRequest) -> FetchResponse:
            raise self.exc

    for exc, words in ((TimeoutError(), "timed out"), (ConnectionRefusedError(), "could not fetch")):
        network = MediaNetwork(FakeResolver(DNS), Failing(exc))
        with pytest.raises(ImageInputError, match=words):
            load_image_bytes("https://img.example.com/a", None, MAX_BYTES, remote_media(ALLOWED, 5.0, network))
    with pytest.raises(ImageInputError, match="does not resolve"):
        load_image_bytes("https://img.example.com/a", None, MAX_BYTES,
                         remote_media(ALLOWED, 5.0, MediaNetwork(FakeResolver({}), FakeFetcher({}))))


def test_the_loopback_seam_opens_loopback_only() -> None:
    data, _ = load("http://loop.example.com/a.png", {("loop.example.com", "/a.png"): ok()},
                   allow_loopback_for_tests=True)
    assert data == PNG
    for host in ("private", "meta", "linklocal"):
        err, fetcher = refused(f"http://{host}.example.com/a.png", allow_loopback_for_tests=True)
        assert err.code == "media_not_allowed" and fetcher.sent == []


def test_domain_list_is_validated() -> None:
    for bad in ("a.com:80", "http://a.com", "a.com/x", "user@a.com"):
        with pytest.raises(ValueError, match="bare host names"):
            remote_media(bad, 5.0)
    with pytest.raises(ValueError, match="timeout"):
        remote_media("a.com", 0.0)
    assert remote_media(" A.com , ,b.org. ", 5.0).allowed_domains == {"a.com", "b.org"}


# ------------------------------------------------------------------- the production fetcher on loopback


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        _Handler.hosts.append(self.headers["Host"])
        if self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
            return
        if self.path == "/endless":  # no Content-Length: the cap must stop the read
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x" * 1024)
            except OSError:
                pass
            return
        if self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def loopback_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_pinned_fetcher_connects_to_the_checked_ip_and_names_the_host(loopback_port: int) -> None:
    # "images.test" resolves (fake DNS) to 127.0.0.1; the socket goes there, the Host header names the domain.
    network = MediaNetwork(FakeResolver({"images.test": ["127.0.0.1"]}), PinnedHTTPFetcher(),
                           allow_loopback_for_tests=True)
    remote = remote_media("images.test", 2.0, network)
    _Handler.hosts.clear()
    assert load_image_bytes(f"http://images.test:{loopback_port}/hop", None, MAX_BYTES, remote) == PNG
    assert _Handler.hosts == [f"images.test:{loopback_port}"] * 2
    with pytest.raises(ImageInputError) as info:
        load_image_bytes(f"http://images.test:{loopback_port}/endless", None, MAX_BYTES, remote)
    assert info.value.code == "image_too_large"
    slow = remote_media("images.test", 0.5, network)
    t0 = time.monotonic()
    with pytest.raises(ImageInputError, match="timed out"):
        load_image_bytes(f"http://images.test:{loopback_port}/slow", None, MAX_BYTES, slow)
    assert time.monotonic() - t0 < 1.5
    without_seam = remote_media("images.test", 2.0, MediaNetwork(FakeResolver({"images.test": ["127.0.0.1"]})))
    _Handler.hosts.clear()
    with pytest.raises(ImageInputError, match="loopback"):
        load_image_bytes(f"http://images.test:{loopback_port}/a.png", None, MAX_BYTES, without_seam)
    assert _Handler.hosts == []

"""Turn an OpenAI ``image_url`` (or vLLM's ``video_url``) string into media bytes, without trusting
it.

Accepted: ``data:image/<type>;base64,<payload>`` (strict base64); local paths / ``file://`` URLs
only when the server has an allowed media directory and the path, after following symlinks, lies
inside it; ``http(s)`` URLs only when the server names their host in ``RemoteMedia.allowed_domains``
(off by default).

Remote fetches (SSRF rules): the host must be on the allow-list; every address it resolves to must
be public (never loopback, private, link-local, cloud metadata, unspecified, multicast or reserved);
the connection goes to the checked address itself (the ``Fetcher`` contract), so a second DNS answer
cannot swap it (rebinding); redirects are followed by hand, at most ``max_redirects``, each hop
checked again from scratch; the body is capped at ``max_image_bytes`` while it streams; one deadline
(``timeout_s``) covers every hop.

Size is checked before decoding base64 or reading a file. Errors are ImageInputError
(VideoInputError for videos: ``load_video_bytes``, the same rules with ``data:video/*`` and video
words and codes) with messages that never echo payload bytes, URLs, or reveal files outside the dir.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import os
import socket
import ssl
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urljoin, urlparse, urlsplit

from firsttoken.inputs.image import ImageInputError


@dataclass(frozen=True)
class MediaKind:
    """What is being loaded: the noun in messages, the data-URL media type, the error class and its
    codes. Images and videos come through the same checks; only the words and the codes differ."""

    noun: str  # "image" | "video"
    error: type[ImageInputError]
    invalid: str  # code for a malformed or missing one
    too_large: str  # code for one over the byte cap

    def fail(self, code: str, message: str) -> ImageInputError:
        return self.error(code, message)


IMAGE = MediaKind("image", ImageInputError, "invalid_image", "image_too_large")


def load_image_bytes(
    url: str,
    allowed_media_dir: Path | None,
    max_image_bytes: int,
    remote: RemoteMedia | None = None,
) -> bytes:
    """The raw (still encoded) image bytes ``url`` names, at most ``max_image_bytes`` of them."""
    return load_media_bytes(url, allowed_media_dir, max_image_bytes, remote, IMAGE)


def load_video_bytes(
    url: str,
    allowed_media_dir: Path | None,
    max_video_bytes: int,
    remote: RemoteMedia | None = None,
) -> bytes:
    """The raw (still encoded) video bytes ``url`` names, at most ``max_video_bytes`` of them: the
    same sources and checks as images (data:video/*, the media directory, allow-listed hosts),
    errors as VideoInputError."""
    from firsttoken.inputs.video import VideoInputError

    kind = MediaKind("video", VideoInputError, "invalid_video", "video_too_large")
    return load_media_bytes(url, allowed_media_dir, max_video_bytes, remote, kind)


def load_media_bytes(
    url: str,
    allowed_media_dir: Path | None,
    max_bytes: int,
    remote: RemoteMedia | None,
    kind: MediaKind,
) -> bytes:
    scheme = url[: url.find(":")].lower() if ":" in url else ""
    if scheme == "data":
        return _load_data_url(url, max_bytes, kind)
    if scheme in ("http", "https"):
        if remote is None or not remote.allowed_domains:
            raise kind.fail(
                "media_not_allowed", f"remote {kind.noun} URLs are disabled on this server"
            )
        return _fetch_remote(url, remote, max_bytes, kind)
    if scheme == "file":
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise kind.fail("media_not_allowed", "file:// URLs must name a local file")
        return _load_file(unquote(parsed.path), allowed_media_dir, max_bytes, kind)
    if scheme and len(scheme) > 1:  # "c:" would be a Windows drive, anything longer a URL scheme
        raise kind.fail("media_not_allowed", f"unsupported {kind.noun} URL scheme; use a data: URL")
    return _load_file(url, allowed_media_dir, max_bytes, kind)


def base64_decoded_len(payload: str) -> int:
    """Bytes a padded base64 payload decodes to, from its length alone."""
    padding = len(payload) - len(payload.rstrip("="))
    return len(payload) // 4 * 3 - min(padding, 2)


def _load_data_url(url: str, max_bytes: int, kind: MediaKind = IMAGE) -> bytes:
    noun = kind.noun
    header, sep, payload = url.partition(",")
    if not sep:
        raise kind.fail(kind.invalid, "malformed data URL: missing ','")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if not media_type.startswith(f"{noun}/"):
        raise kind.fail(
            kind.invalid,
            f"data URL must have an {noun}/* media type"
            if noun == "image"
            else f"data URL must have a {noun}/* media type",
        )
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise kind.fail(kind.invalid, f"{noun} data URLs must be base64-encoded")
    size = base64_decoded_len(payload)
    if size > max_bytes:
        raise kind.fail(kind.too_large, f"{noun} is {size} bytes; the limit is {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise kind.fail(kind.invalid, f"{noun} data URL is not valid base64") from None


def _load_file(
    raw_path: str, allowed_media_dir: Path | None, max_bytes: int, kind: MediaKind = IMAGE
) -> bytes:
    noun = kind.noun
    if allowed_media_dir is None:
        raise kind.fail("media_not_allowed", f"local {noun} paths are disabled on this server")
    if "\x00" in raw_path:  # no file can have such a name (path functions raise ValueError on it)
        raise kind.fail(kind.invalid, f"{noun} path contains a NUL byte")
    root = allowed_media_dir.resolve()
    try:
        # an absolute raw_path replaces root; symlinks are followed
        path = (root / raw_path).resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError) or a name the OS refuses
        raise kind.fail(
            kind.invalid, f"{noun} path cannot be resolved in the media directory"
        ) from None
    if not path.is_relative_to(root):
        raise kind.fail(
            "media_not_allowed",
            f"local {noun} paths are only allowed inside the server's media directory",
        )
    try:
        # O_NOFOLLOW: a symlink swapped in after resolve() is refused; O_NONBLOCK: a FIFO can't hang
        # us.
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except OSError:
        raise kind.fail(kind.invalid, f"{noun} file not found in the media directory") from None
    # closed on every way out, a refused path included (a directory opens fine, then is refused)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise kind.fail(
                kind.invalid,
                f"{noun} path is {what}; name an {noun} file"
                if noun == "image"
                else f"{noun} path is {what}; name a {noun} file",
            )
        if st.st_size > max_bytes:
            raise kind.fail(
                kind.too_large, f"{noun} is {st.st_size} bytes; the limit is {max_bytes} bytes"
            )
        data = _read_at_most(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # the file grew after fstat
        raise kind.fail(kind.too_large, f"{noun} exceeds the limit of {max_bytes} bytes")
    return data


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------- remote


class Resolver(Protocol):
    """Host name -> every IP address (text form) it resolves to. Raises OSError when it does not
    resolve."""

    def resolve(self, host: str, port: int) -> list[str]: ...


@dataclass(frozen=True)
class FetchRequest:
    """One HTTP GET, to be sent to ``ip`` (already checked) while naming ``host`` (Host header, TLS
    SNI and certificate check)."""

    scheme: str  # "http" | "https"
    host: str
    port: int
    target: str  # path + query, e.g. "/a.png?x=1"
    ip: str
    timeout_s: float  # what is left of the whole fetch's deadline
    max_bytes: int  # read at most max_bytes + 1 body bytes
    accept: str = "image/*"  # the Accept header: image/* or video/*


@dataclass(frozen=True)
class FetchResponse:
    status: int
    location: str | None  # the Location header of a redirect
    content_length: int | None  # as declared; a body declared over max_bytes need not be read
    body: bytes  # at most max_bytes + 1 bytes (one more than allowed says "too large")


class Fetcher(Protocol):
    """Performs one request exactly as described: connects to ``request.ip``, never re-resolves
    ``host``, never follows redirects. Network failures raise OSError (timeouts: TimeoutError)."""

    def fetch(self, request: FetchRequest) -> FetchResponse: ...


class SystemResolver:
    def resolve(self, host: str, port: int) -> list[str]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _PinnedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, request: FetchRequest) -> None:
        super().__init__(request.host, request.port, timeout=request.timeout_s)
        self._ip = request.ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, request: FetchRequest, context: ssl.SSLContext) -> None:
        super().__init__(request.host, request.port, timeout=request.timeout_s, context=context)
        self._ip = request.ip
        self._tls = context

    def connect(self) -> None:
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        # SNI + certificate name: the host
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


class PinnedHTTPFetcher:
    """The production Fetcher: http.client over a socket to the checked IP, the body read in chunks
    up to the cap and the deadline."""

    chunk_bytes = 64 * 1024

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        # None: the system's default context, made on the first https fetch (loading CAs costs)
        self._tls = tls

    def fetch(self, request: FetchRequest) -> FetchResponse:
        deadline = time.monotonic() + request.timeout_s
        conn: http.client.HTTPConnection
        if request.scheme == "https":
            self._tls = self._tls or ssl.create_default_context()
            conn = _PinnedHTTPSConnection(request, self._tls)
        else:
            conn = _PinnedHTTPConnection(request)
        try:
            conn.request(
                "GET",
                request.target,
                headers={"Accept": request.accept, "User-Agent": "firsttoken"},
            )
            resp = conn.getresponse()
            declared = resp.getheader("Content-Length")
            length = int(declared) if declared and declared.isdigit() else None
            if resp.status != 200 or (length is not None and length > request.max_bytes):
                return FetchResponse(resp.status, resp.getheader("Location"), length, b"")
            chunks: list[bytes] = []
            size = 0
            while size <= request.max_bytes:
                if time.monotonic() > deadline:
                    raise TimeoutError("media fetch deadline passed")
                chunk = resp.read1(min(self.chunk_bytes, request.max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return FetchResponse(resp.status, None, length, b"".join(chunks))
        except (http.client.HTTPException, ValueError) as err:  # malformed responses
            raise OSError("bad HTTP response") from err
        finally:
            conn.close()


# Cloud metadata endpoints, named for the error message; both are also caught by the general rules.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)


def forbidden_address_reason(ip_text: str, allow_loopback: bool = False) -> str | None:
    """Why a remote image may not come from this address, or None when it is a public unicast
    address."""
    try:
        ip = ipaddress.ip_address(ip_text.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    except ValueError:
        return "an unparseable address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_loopback:
        return None if allow_loopback else "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_private or ip.is_reserved or not ip.is_global:
        return "a private or reserved address"
    return None


@dataclass(frozen=True)
class MediaNetwork:
    """How remote images reach the network: the seams tests replace (production: the system resolver
    and the pinned fetcher). ``allow_loopback_for_tests`` lets a test reach a loopback server
    through an allowed name; it exists only as this constructor argument (no flag or request field
    sets it), and private, link-local and metadata addresses stay refused even with it."""

    resolver: Resolver = field(default_factory=SystemResolver)
    fetcher: Fetcher = field(default_factory=PinnedHTTPFetcher)
    allow_loopback_for_tests: bool = False


@dataclass(frozen=True)
class RemoteMedia:
    """Remote http(s) image URLs: refused unless ``allowed_domains`` names the exact host (any case,
    no port)."""

    allowed_domains: frozenset[str]
    timeout_s: float  # the whole fetch: resolution of every hop, connect, redirects, body
    max_redirects: int = 3
    network: MediaNetwork = field(default_factory=MediaNetwork)

    def __post_init__(self) -> None:
        domains = frozenset(d.strip().lower().rstrip(".") for d in self.allowed_domains)
        if any(not d or any(c in d for c in "/:@\\ ") for d in domains):
            raise ValueError(
                "allowed_domains must be bare host names without port, e.g. images.example.com"
            )
        object.__setattr__(self, "allowed_domains", domains)
        if not self.timeout_s > 0:
            raise ValueError("media fetch timeout_s must be > 0")
        if self.max_redirects < 0:
            raise ValueError("max_redirects must be >= 0")


def remote_media(
    domains: str | Iterable[str], timeout_s: float, network: MediaNetwork | None = None
) -> RemoteMedia:
    """RemoteMedia from a comma-separated host list (``a.com,b.org``) or the config's tuple, and a
    fetch timeout."""
    names = domains.split(",") if isinstance(domains, str) else domains
    return RemoteMedia(
        frozenset(d for d in names if d.strip()), timeout_s, network=network or MediaNetwork()
    )


_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def _fetch_remote(url: str, remote: RemoteMedia, max_bytes: int, kind: MediaKind = IMAGE) -> bytes:
    noun = kind.noun
    timed_out = f"fetching the {noun} URL timed out (limit {remote.timeout_s:g} s)"
    deadline = time.monotonic() + remote.timeout_s
    for _ in range(remote.max_redirects + 1):
        request = _checked_request(url, remote, deadline, max_bytes, kind)
        try:
            resp = remote.network.fetcher.fetch(request)
        except TimeoutError:
            raise kind.fail(kind.invalid, timed_out) from None
        except OSError:
            raise kind.fail(kind.invalid, f"could not fetch the {noun} URL") from None
        if resp.status in _REDIRECTS:
            if not resp.location:
                raise kind.fail(kind.invalid, f"the {noun} URL redirected without a location")
            url = urljoin(url, resp.location)
            continue
        if resp.status != 200:
            raise kind.fail(kind.invalid, f"fetching the {noun} URL returned HTTP {resp.status}")
        size = max(len(resp.body), resp.content_length or 0)
        if size > max_bytes:
            raise kind.fail(kind.too_large, f"remote {noun} exceeds the limit of {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise kind.fail(kind.invalid, timed_out)
        return resp.body
    raise kind.fail(
        "media_not_allowed", f"the {noun} URL redirected more than {remote.max_redirects} times"
    )


def _checked_request(
    url: str, remote: RemoteMedia, deadline: float, max_bytes: int, kind: MediaKind = IMAGE
) -> FetchRequest:
    """The request for one hop, after the scheme, host and every resolved address passed the
    rules."""
    noun = kind.noun
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise kind.fail(kind.invalid, f"malformed {noun} URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise kind.fail(
            "media_not_allowed", f"the {noun} URL redirected to a scheme other than http(s)"
        )
    if "@" in parts.netloc or "\\" in url:
        raise kind.fail(
            "media_not_allowed", f"{noun} URLs may not carry credentials or backslashes"
        )
    host = (parts.hostname or "").rstrip(".")
    if not host or host not in remote.allowed_domains:
        raise kind.fail(
            "media_not_allowed",
            f"the {noun} URL's host is not in this server's allowed media domains",
        )
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise kind.fail(
            kind.invalid, f"fetching the {noun} URL timed out (limit {remote.timeout_s:g} s)"
        )
    try:
        ips = remote.network.resolver.resolve(host, port)
    except (OSError, UnicodeError):
        raise kind.fail(kind.invalid, f"the {noun} URL's host does not resolve") from None
    if not ips:
        raise kind.fail(kind.invalid, f"the {noun} URL's host does not resolve")
    for ip in ips:  # every answer must pass: a mixed record set is refused rather than raced
        reason = forbidden_address_reason(ip, remote.network.allow_loopback_for_tests)
        if reason:
            raise kind.fail(
                "media_not_allowed", f"the {noun} URL's host resolves to {reason}; refused"
            )
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return FetchRequest(scheme, host, port, target, ips[0], remaining_s, max_bytes, f"{noun}/*")

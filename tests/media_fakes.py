"""Fake DNS and HTTP for remote-image tests: the inputs.media Resolver and Fetcher seams, no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from firsttoken.inputs.media import FetchRequest, FetchResponse


@dataclass
class FakeResolver:
    table: dict[str, list[str]]
    asked: list[str] = field(default_factory=list)

    def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host not in self.table:
            raise OSError("no such host")
        return self.table[host]


@dataclass
class FakeFetcher:
    """Answers by (host, target), 404 otherwise; records every request it was asked to send. Like the real
    fetcher, hands back at most ``max_bytes + 1`` body bytes."""

    routes: dict[tuple[str, str], FetchResponse]
    sent: list[FetchRequest] = field(default_factory=list)

    def fetch(self, request: FetchRequest) -> FetchResponse:
        self.sent.append(request)
        resp = self.routes.get((request.host, request.target), FetchResponse(404, None, None, b""))
        return replace(resp, body=resp.body[: request.max_bytes + 1])


def ok(body: bytes) -> FetchResponse:
    return FetchResponse(200, None, len(body), body)


def redirect(location: str) -> FetchResponse:
    return FetchResponse(302, location, 0, b"")

"""The HTTP client the ``mariana submit`` / ``mariana jobs ...`` commands use (httpx).

Failures become `MarianaError` (one line, exit 2): no service at the URL, or the service's own message for
a refused request (400 bad argv, 401 token, 404 no such job).
"""

from __future__ import annotations

import os

import httpx
from mariana.platform.core.errors import MarianaError

DEFAULT_URL = "http://127.0.0.1:8765"
FINAL_STATES = ("succeeded", "failed", "cancelled")  # a job in one of these never changes again


def read_token(token_file: str | None) -> str | None:
    """The bearer token from ``token_file`` or env MARIANA_JOBS_TOKEN (None if neither)."""
    if token_file:
        try:
            token = open(os.path.expanduser(token_file)).read().strip()
        except OSError as e:
            raise MarianaError(f"--token-file {token_file}: {e.strerror}") from None
        if not token:
            raise MarianaError(f"--token-file {token_file}: the file is empty")
        bad = next((c for c in token if not "!" <= c <= "~"), None)
        if bad is not None:  # httpx/curl cannot send it in `Authorization: Bearer`, so no client could
            line = token[: token.index(bad) + (bad == "\n")].count("\n") + 1
            what = "a second line" if bad == "\n" else f"{bad!r}"
            raise MarianaError(
                f"--token-file {token_file}: line {line}: the token has {what}; expected one line of "
                "printable ASCII without spaces (a Bearer token)"
            )
        return token
    return os.environ.get("MARIANA_JOBS_TOKEN") or None


class JobsClient:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("MARIANA_JOBS_URL") or DEFAULT_URL).rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)

    def request(self, method: str, path: str, **kw) -> dict:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError:
            raise MarianaError(
                f"no job service at {self.url} (start one with `mariana jobs serve`)"
            ) from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            if isinstance(detail, list):  # FastAPI validation errors
                detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
            if r.status_code == 400:  # the service's own one-line message about the request
                raise MarianaError(str(detail))
            raise MarianaError(f"{self.url}{path}: {detail} (HTTP {r.status_code})")
        return r.json()

    def submit(
        self, argv: list[str], priority: int = 0, name: str = "", cwd: str = "", resources: dict | None = None
    ) -> dict:
        body = {"argv": argv, "priority": priority, "name": name, "cwd": cwd, "resources": resources or {}}
        return self.request("POST", "/api/jobs", json=body)

    def jobs(self) -> list[dict]:
        return self.request("GET", "/api/jobs")["jobs"]

    def job(self, job_id: int) -> dict:
        return self.request("GET", f"/api/jobs/{job_id}")

    def logs(self, job_id: int, tail: int = 200, offset: int | None = None) -> dict:
        params = {"tail": tail} if offset is None else {"offset": offset}
        return self.request("GET", f"/api/jobs/{job_id}/logs", params=params)

    def metrics(self, job_id: int, after: int = 0) -> dict:
        return self.request("GET", f"/api/jobs/{job_id}/metrics", params={"after": after})

    def cancel(self, job_id: int, reason: str | None = None) -> dict:
        return self.request("POST", f"/api/jobs/{job_id}/cancel", json={"reason": reason} if reason else None)

    def retry(self, job_id: int) -> dict:
        return self.request("POST", f"/api/jobs/{job_id}/retry")

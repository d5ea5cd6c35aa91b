"""Workers found through the Kubernetes API: pods matching a label selector join the pool when they
are Ready and leave it when they stop being Ready or go away (`--service-discovery k8s --selector ...`).

Plain HTTP against the API server (no `kubernetes` client), in a loop:

    list   GET /api/v1/namespaces/NS/pods?labelSelector=SEL                  -> items, resourceVersion RV
    watch  GET .../pods?labelSelector=SEL&watch=1&resourceVersion=RV&allowWatchBookmarks=true
           one JSON event a line: {"type": ADDED | MODIFIED | DELETED | BOOKMARK | ERROR, "object": ...}

A list reconciles: workers this discovery added whose pod is gone or not Ready are removed, Ready pods
not yet in the pool are added. A watch ends when the API server closes it (timeoutSeconds) and is
re-opened from the last resourceVersion seen; a 410 Gone ("too old resource version") or any error
goes back to a list (after a backoff on errors). Workers given with --worker-urls or POST /workers
are never removed here.

In a pod, the service account gives everything: the API server at
https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the token and CA under
/var/run/secrets/kubernetes.io/serviceaccount/ (the token is re-read for every request: bound tokens
rotate), and the namespace. The router's role needs `get, list, watch` on pods (deploy/k8s/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger("strata.router")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; it is then re-opened
BACKOFF_S = (0.5, 30.0)  # first and largest wait after a failed list or watch


class DiscoveryError(Exception):
    """The API server said no (e.g. 403: the router's service account may not list pods)."""


def pod_url(pod: dict[str, Any], port: int | None) -> str | None:
    """`http://podIP:port` for a pod that should get traffic now, None for one that should not
    (not Running, not Ready, being deleted, no IP yet, or no port to use)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if (
        meta.get("deletionTimestamp")
        or status.get("phase") != "Running"
        or not status.get("podIP")
    ):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    if not ready:
        return None
    if port is None:  # the container port named "http"
        ports = [
            p
            for c in (pod.get("spec") or {}).get("containers") or []
            for p in c.get("ports") or []
        ]
        port = next(
            (p.get("containerPort") for p in ports if p.get("name") == "http"), None
        )
        if port is None:
            logger.warning(
                "pod %s has no container port named 'http'; give --k8s-port",
                meta.get("name"),
            )
            return None
    ip = status["podIP"]
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


class K8sDiscovery:
    """Keeps the pool's discovered workers equal to the Ready pods matching `selector`.

    `add(url)` and `remove(url)` are the pool's (KeyError: already there / not there). Runs as one
    task on the router's event loop; `start()` begins it, `close()` ends it."""

    def __init__(
        self,
        *,
        api_url: str,
        namespace: str,
        selector: str,
        port: int | None,
        add: Callable[[str], Awaitable[Any]],
        remove: Callable[[str], Awaitable[Any]],
        token_path: Path | None = None,
        ca_path: Path | None = None,
    ):
        self.selector = selector
        self.port = port
        self.add, self.remove = add, remove
        self.token_path = token_path
        self.pods_path = f"/api/v1/namespaces/{namespace}/pods"
        verify: ssl.SSLContext | bool = True
        if ca_path is not None and ca_path.exists():
            verify = ssl.create_default_context(cafile=str(ca_path))
        self.client = httpx.AsyncClient(
            base_url=api_url.rstrip("/"),
            verify=verify,
            timeout=httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30.0),
            trust_env=False,
        )
        self.workers: dict[
            str, str
        ] = {}  # pod name -> the URL this discovery registered for it
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set after the first successful list
        self._task: asyncio.Task | None = None

    @classmethod
    def in_cluster(
        cls,
        selector: str,
        *,
        add: Callable[[str], Awaitable[Any]],
        remove: Callable[[str], Awaitable[Any]],
        namespace: str | None = None,
        port: int | None = None,
        api_url: str | None = None,
        service_account_dir: Path | None = None,
    ) -> K8sDiscovery:
        """From the pod's service account; `namespace` and `api_url` override what it gives."""
        sa_dir = service_account_dir or SERVICE_ACCOUNT_DIR
        api_url, namespace = in_cluster_settings(namespace, api_url, sa_dir)
        token = sa_dir / "token"
        return cls(
            api_url=api_url,
            namespace=namespace,
            selector=selector,
            port=port,
            add=add,
            remove=remove,
            token_path=token if token.exists() else None,
            ca_path=sa_dir / "ca.crt",
        )

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.client.aclose()

    async def run(self) -> None:
        backoff = BACKOFF_S[0]
        while True:
            try:
                await self.list_pods()
                backoff = BACKOFF_S[0]
                while await self.watch_pods():
                    pass  # the server closed the watch normally: re-open it from the last version
                logger.info(
                    "k8s discovery: watch expired (410 Gone); listing pods again"
                )
            except asyncio.CancelledError:
                raise
            except (
                httpx.HTTPError,
                DiscoveryError,
                ValueError,
                KeyError,
                TypeError,
            ) as exc:
                logger.warning(
                    "k8s discovery: %s; retrying in %.1fs", describe(exc), backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])

    # ---------------------------------------------------------------- list and watch

    def headers(self) -> dict[str, str]:
        if self.token_path is None:
            return {}
        return {"Authorization": f"Bearer {self.token_path.read_text().strip()}"}

    async def list_pods(self) -> None:
        resp = await self.client.get(
            self.pods_path,
            params={"labelSelector": self.selector},
            headers=self.headers(),
        )
        check(resp)
        body = resp.json()
        self.resource_version = body["metadata"]["resourceVersion"]
        wanted = {}
        for pod in body.get("items") or []:
            url = pod_url(pod, self.port)
            if url is not None:
                wanted[pod["metadata"]["name"]] = url
        for name, url in list(self.workers.items()):
            if wanted.get(name) != url:
                await self._drop(name)
        for name, url in wanted.items():
            if name not in self.workers:
                await self._admit(name, url)
        self.synced.set()

    async def watch_pods(self) -> bool:
        """One watch, until the server ends it: True to watch again, False to list again (410 Gone)."""
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "resourceVersion": self.resource_version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        async with self.client.stream(
            "GET", self.pods_path, params=params, headers=self.headers()
        ) as resp:
            if resp.status_code == 410:
                return False
            if resp.status_code != 200:
                await resp.aread()
                check(resp)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return False
                    raise DiscoveryError(
                        f"watch error {obj.get('code')}: {obj.get('message')}"
                    )
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    self.resource_version = version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    await self.on_pod(obj, deleted=kind == "DELETED")
        return True

    async def on_pod(self, pod: dict[str, Any], *, deleted: bool = False) -> None:
        name = pod["metadata"]["name"]
        url = None if deleted else pod_url(pod, self.port)
        if self.workers.get(name) == url:
            return
        if name in self.workers:
            await self._drop(name)
        if url is not None:
            await self._admit(name, url)

    # ---------------------------------------------------------------- the pool

    async def _admit(self, name: str, url: str) -> None:
        try:
            await self.add(url)
        except (
            KeyError
        ):  # registered otherwise (--worker-urls, POST /workers): not ours to remove
            logger.info("k8s discovery: pod %s (%s) is already a worker", name, url)
            return
        self.workers[name] = url
        logger.info("k8s discovery: pod %s is Ready; added %s", name, url)

    async def _drop(self, name: str) -> None:
        url = self.workers.pop(name)
        with contextlib.suppress(KeyError):  # removed meanwhile through DELETE /workers
            await self.remove(url)
        logger.info("k8s discovery: pod %s is gone or not Ready; removed %s", name, url)


def in_cluster_settings(
    namespace: str | None, api_url: str | None, service_account_dir: Path | None = None
) -> tuple[str, str]:
    """(API server URL, namespace): given, else the pod's own. ValueError saying which flag to give."""
    sa_dir = service_account_dir or SERVICE_ACCOUNT_DIR
    if api_url is None:
        host, port = (
            os.environ.get("KUBERNETES_SERVICE_HOST"),
            os.environ.get("KUBERNETES_SERVICE_PORT"),
        )
        if not host or not port:
            raise ValueError(
                "--service-discovery k8s: not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST); "
                "give --k8s-api-url, e.g. http://127.0.0.1:8001 with `kubectl proxy --port 8001`"
            )
        api_url = (
            f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        )
    if namespace is None:
        ns_file = sa_dir / "namespace"
        if not ns_file.exists():
            raise ValueError(
                f"--service-discovery k8s: no {ns_file} to read the namespace from; give --k8s-namespace"
            )
        namespace = ns_file.read_text().strip()
    return api_url, namespace


def check(resp: httpx.Response) -> None:
    if resp.status_code != 200:
        try:
            message = resp.json().get("message", resp.text[:200])
        except ValueError:
            message = resp.text[:200]
        hint = (
            " (the router's service account needs get/list/watch on pods: deploy/k8s/router.yaml)"
            if resp.status_code in (401, 403)
            else ""
        )
        raise DiscoveryError(
            f"GET {resp.request.url.path} answered {resp.status_code}: {message}{hint}"
        )


def describe(exc: BaseException) -> str:
    return (
        str(exc) if isinstance(exc, DiscoveryError) else f"{type(exc).__name__}: {exc}"
    )

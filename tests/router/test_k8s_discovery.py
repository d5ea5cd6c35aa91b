"""`--service-discovery k8s`: a router that follows Ready pods through a fake Kubernetes API (list +
watch of pods by label selector, served in-process), over fake workers."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from router_fakes import FakeWorker, RouterThread, ThreadServer

from strata.router import k8s_discovery
from strata.router.config import RouterConfig
from strata.router.k8s_discovery import pod_url

NAMESPACE = "inference"
SELECTOR = "app=strata,component=replica"
TOKEN = "service-account-token"


def make_pod(
    name: str,
    port: int,
    *,
    ready: bool = True,
    labels: dict | None = None,
    ip: str = "127.0.0.1",
):
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": labels or {"app": "strata", "component": "replica"},
        },
        "spec": {
            "containers": [
                {"name": "strata", "ports": [{"name": "http", "containerPort": port}]}
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKubeAPI(ThreadServer):
    """The pods part of the Kubernetes API: list and watch by label selector, with resourceVersions.

    Tests change pods with put()/delete() (each a watch event), or silently (emit=False) to model
    changes a router missed; expire_watches() ends every open watch with a 410 Gone."""

    def __init__(self):
        self.lock = threading.Lock()
        self.version = 100
        self.pods: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod)
        self.requests: list[dict] = []  # {"params", "authorization"} of each request
        self.fail_lists = 0  # answer this many lists with 403
        self.expired_before = 0  # a watch from an older version gets 410
        self.watchers: list[queue.Queue] = []
        super().__init__(self._app())

    # -------------------------------------------------------------- what tests do

    def put(self, pod: dict, *, emit: bool = True) -> None:
        with self.lock:
            kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
            self._change(kind, pod, emit)

    def delete(self, name: str, *, emit: bool = True) -> None:
        with self.lock:
            self._change("DELETED", self.pods[name], emit)

    def expire_watches(self) -> None:
        with self.lock:
            self.expired_before = self.version  # a watch from before the silent changes
            for q in self.watchers:
                q.put(
                    {
                        "type": "ERROR",
                        "object": {
                            "kind": "Status",
                            "code": 410,
                            "message": "too old resource version",
                        },
                    }
                )

    def end_watches(self) -> None:
        """End every open watch normally, as the API server does after timeoutSeconds."""
        with self.lock:
            for q in self.watchers:
                q.put({"type": "END"})

    def _change(self, kind: str, pod: dict, emit: bool) -> None:
        self.version += 1
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"])
        else:
            self.pods[pod["metadata"]["name"]] = pod
        if emit:
            self.events.append((self.version, kind, pod))
            for q in self.watchers:
                q.put({"type": kind, "object": pod})

    # -------------------------------------------------------------- the API

    def _app(self) -> FastAPI:
        app = FastAPI()

        def matches(pod: dict, selector: str) -> bool:
            labels = pod["metadata"].get("labels") or {}
            return all(
                labels.get(k) == v
                for k, v in (term.split("=", 1) for term in selector.split(","))
            )

        @app.get(f"/api/v1/namespaces/{NAMESPACE}/pods")
        async def pods(request: Request):
            params = dict(request.query_params)
            self.requests.append(
                {
                    "params": params,
                    "authorization": request.headers.get("authorization"),
                }
            )
            selector = params["labelSelector"]
            if params.get("watch") != "1":
                with self.lock:
                    if self.fail_lists > 0:
                        self.fail_lists -= 1
                        return Response(
                            json.dumps(
                                {
                                    "kind": "Status",
                                    "code": 403,
                                    "message": "pods is forbidden",
                                }
                            ),
                            403,
                        )
                    items = [p for p in self.pods.values() if matches(p, selector)]
                    return {
                        "kind": "PodList",
                        "metadata": {"resourceVersion": str(self.version)},
                        "items": items,
                    }
            since = int(params["resourceVersion"])
            with self.lock:
                if since < self.expired_before:
                    return Response(
                        json.dumps({"kind": "Status", "code": 410, "message": "Gone"}),
                        410,
                    )
                q: queue.Queue = queue.Queue()
                for version, kind, pod in self.events:
                    if version > since:
                        q.put({"type": kind, "object": pod})
                self.watchers.append(q)

            async def stream():
                try:
                    while True:
                        try:
                            event = q.get_nowait()
                        except queue.Empty:
                            await asyncio.sleep(0.02)
                            continue
                        if event["type"] == "END":
                            return
                        if event["type"] == "ERROR" or matches(
                            event["object"], selector
                        ):
                            yield json.dumps(event) + "\n"
                        if event["type"] == "ERROR":
                            return
                finally:
                    with self.lock:
                        self.watchers.remove(q)

            return StreamingResponse(stream(), media_type="application/json")

        return app


@pytest.fixture(scope="module")
def workers():
    ws = [FakeWorker(name).start() for name in ("a", "b", "static")]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture
def kube():
    api = FakeKubeAPI().start()
    yield api
    api.stop()


@pytest.fixture
def service_account(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "namespace").write_text(NAMESPACE)
    monkeypatch.setattr(k8s_discovery, "SERVICE_ACCOUNT_DIR", tmp_path)
    return tmp_path


@pytest.fixture
def router(kube, service_account, workers):
    routers = []

    def make(**config) -> RouterThread:
        r = RouterThread(
            service_discovery="k8s", selector=SELECTOR, k8s_api_url=kube.url, **config
        ).start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


def wait_workers(
    router: RouterThread, expected: set[str], timeout: float = 10.0
) -> None:
    router.wait_for(
        lambda ws: set(ws) == expected, timeout, f"workers {sorted(expected)}"
    )


def test_ready_pods_join_and_leave(kube, router, workers):
    a, b, static = workers
    kube.put(make_pod("replica-a", a.port))
    kube.put(make_pod("replica-b", b.port, ready=False))
    kube.put(make_pod("other", static.port, labels={"app": "something-else"}))
    r = router(worker_urls=(static.url,))
    wait_workers(r, {static.url, a.url})
    r.wait_for(lambda ws: ws[a.url]["healthy"], what="replica-a healthy")

    kube.put(make_pod("replica-b", b.port))  # becomes Ready
    wait_workers(r, {static.url, a.url, b.url})
    kube.delete("replica-a")  # goes away
    wait_workers(r, {static.url, b.url})
    kube.put(
        make_pod("replica-b", b.port, ready=False)
    )  # stops being Ready (e.g. failing probes)
    wait_workers(
        r, {static.url}
    )  # the worker given on the command line is never dropped by discovery

    lists = [q for q in kube.requests if q["params"].get("watch") != "1"]
    watches = [q for q in kube.requests if q["params"].get("watch") == "1"]
    assert lists and watches
    assert all(q["params"]["labelSelector"] == SELECTOR for q in kube.requests)
    assert all(
        q["authorization"] == f"Bearer {TOKEN}" for q in kube.requests
    )  # the service account's token
    assert (
        watches[0]["params"]["resourceVersion"] == "103"
    )  # from the list, not from scratch


def test_an_expired_watch_relists_and_catches_up_on_missed_changes(
    kube, router, workers
):
    a, b, _ = workers
    kube.put(make_pod("replica-a", a.port))
    r = router()
    wait_workers(r, {a.url})
    num_lists = sum(q["params"].get("watch") != "1" for q in kube.requests)
    # changes the router never hears of as events: only a new list shows them
    kube.delete("replica-a", emit=False)
    kube.put(make_pod("replica-b", b.port), emit=False)
    time.sleep(0.3)
    assert set(r.workers()) == {a.url}
    kube.expire_watches()
    wait_workers(r, {b.url})
    assert sum(q["params"].get("watch") != "1" for q in kube.requests) == num_lists + 1


def test_a_watch_the_server_ends_is_reopened_from_the_last_version_seen(
    kube, router, workers
):
    a, b, _ = workers
    r = router()
    kube.put(make_pod("replica-a", a.port))
    wait_workers(r, {a.url})
    kube.end_watches()
    deadline = time.monotonic() + 10
    while sum(q["params"].get("watch") == "1" for q in kube.requests) < 2:
        assert time.monotonic() < deadline, kube.requests
        time.sleep(0.05)
    watches = [q for q in kube.requests if q["params"].get("watch") == "1"]
    assert watches[-1]["params"]["resourceVersion"] == str(
        kube.version
    )  # the pod's event, not the list's
    assert (
        sum(q["params"].get("watch") != "1" for q in kube.requests) == 1
    )  # no relist needed
    kube.put(make_pod("replica-b", b.port))
    wait_workers(r, {a.url, b.url})


def test_api_errors_are_retried_until_the_api_answers(kube, router, workers):
    a, _, _ = workers
    kube.put(make_pod("replica-a", a.port))
    kube.fail_lists = 2
    r = router()
    wait_workers(r, {a.url}, timeout=15)  # after two 403s and their backoff
    assert kube.fail_lists == 0


def test_pod_url_only_for_pods_that_should_get_traffic():
    assert pod_url(make_pod("p", 30000), None) == "http://127.0.0.1:30000"
    assert (
        pod_url(make_pod("p", 30000), 8080) == "http://127.0.0.1:8080"
    )  # --k8s-port wins
    assert pod_url(make_pod("p", 30000, ip="fd00::5"), None) == "http://[fd00::5]:30000"
    assert pod_url(make_pod("p", 30000, ready=False), None) is None
    pending = make_pod("p", 30000)
    pending["status"]["phase"] = "Pending"
    assert pod_url(pending, None) is None
    deleting = make_pod("p", 30000)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_url(deleting, None) is None
    no_ip = make_pod("p", 30000)
    del no_ip["status"]["podIP"]
    assert pod_url(no_ip, None) is None
    unnamed = make_pod("p", 30000)
    unnamed["spec"]["containers"][0]["ports"][0]["name"] = "metrics"
    assert pod_url(unnamed, None) is None


def test_config_says_what_is_missing():
    with pytest.raises(ValueError, match="needs --selector"):
        RouterConfig(service_discovery="k8s")
    with pytest.raises(ValueError, match="service_discovery must be one of"):
        RouterConfig(service_discovery="consul", selector="app=strata")
    with pytest.raises(ValueError, match="--selector is for --service-discovery k8s"):
        RouterConfig(selector="app=strata")


def test_outside_a_cluster_the_router_says_which_flag_to_give(
    tmp_path, monkeypatch, capsys
):
    from strata.cli import build_parser
    from strata.router.cli import router_main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(
        k8s_discovery, "SERVICE_ACCOUNT_DIR", tmp_path
    )  # no namespace file there
    argv = [
        "router",
        "--port",
        "0",
        "--service-discovery",
        "k8s",
        "--selector",
        SELECTOR,
    ]
    assert router_main(build_parser().parse_args(argv)) == 2
    assert "give --k8s-api-url" in capsys.readouterr().err
    assert (
        router_main(
            build_parser().parse_args([*argv, "--k8s-api-url", "http://127.0.0.1:1"])
        )
        == 2
    )
    assert "give --k8s-namespace" in capsys.readouterr().err

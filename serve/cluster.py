"""`jitney serve --replicas N`: N jitney engines behind Ray Serve, one OpenAI-compatible API in front.

    client ──HTTP──▶ Ray Serve's proxy ──▶ Gateway: the API of `serve/app.py`, with the tokenizer only
                                              │ handle.generate(Job), streamed; placed by `JitneyRequestRouter`
                                              ▼   (a `jitney.routers` plugin inside Ray Serve's RequestRouter)
                                       EngineReplica x N: one Engine each, its own share of the cores

The gateway tokenizes and formats; a replica runs the request on its engine and streams its tokens back. A
request is placed when its replica sends the first token: if the replica dies before that, the gateway places
it again on another (Ray Serve replaces the dead one); a replica that dies mid-stream ends the stream with an
error event. Every response names the replica that served it (``x-jitney-replica``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass, field

from jitney.core.request import Completion, Request, RequestError, Sample, SamplingParams, Token
from jitney.routers.base import ReplicaLoad, RoutedRequest, RouterConfig
from jitney.serve.protocol import ApiError

log = logging.getLogger("jitney.serve")

REPLICA_HEADER = "x-jitney-replica"
PLACEMENT_TRIES = 3
"""Replicas a request is offered to, at most, when each dies before its first token."""


@dataclass
class Job:
    """A request as the gateway sends it to a replica (pickled by Ray)."""

    routed: RoutedRequest
    params: SamplingParams
    metadata: dict | None = None

    def request(self) -> Request:
        return Request(self.routed.prompt_ids, self.params, request_id=self.routed.request_id, metadata=self.metadata)


@dataclass
class Placed:
    """A replica's first item of a stream: who serves it, and the first token (None if the request ended
    before any)."""

    replica_id: str
    token: Token | None


# -- routing, inside Ray Serve ------------------------------------------------------------------------------


class _RouterMethods:
    """`JitneyRequestRouter`'s methods (the class itself is built on Ray's bases only when Ray is imported):
    the named `jitney.routers` plugin places each `Job`; other calls (metrics) go to any replica."""

    def initialize_state(self, router: str = "least_loaded", block_size: int = 16, imbalance: float = 0.5) -> None:
        from jitney.core.hooks import make_plugin_manager, registry

        self.policy = registry(make_plugin_manager(), "router").create(
            router, RouterConfig(block_size=block_size, imbalance=imbalance))
        self.outstanding: Counter[str] = Counter()
        self.decided: dict[str, str] = {}  # internal request id -> the replica chosen for it, until it is sent

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """The plugin's replica alone. Ray asks again while that replica does not answer its queue-length probe
        in time (a busy engine): the decision is kept, not taken again, so the request waits for its replica
        rather than going elsewhere (a second rank of "any other" sent a third of the requests astray)."""
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        # (read by its shape: Ray may run this method from a by-value copy of the module, whose `Job` is
        # another class than the gateway's)
        routed = getattr(job, "routed", None)
        if not candidate_replicas or routed is None:
            return [candidate_replicas] if candidate_replicas else []
        key = pending_request.metadata.internal_request_id
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        chosen = self.decided.get(key)
        if chosen not in by_id:  # (a first decision, or its replica has gone)
            loads = [ReplicaLoad(rid, (r.routing_stats or {}).get("running", 0),
                                 (r.routing_stats or {}).get("waiting", 0), self.outstanding[rid])
                     for rid, r in by_id.items()]
            try:
                chosen = self.policy.choose(routed, loads)
            except Exception:  # a router plugin's fault must not stop requests from being served
                log.exception("router %s failed; placing the request on any replica", type(self.policy).__name__)
                return [candidate_replicas]
            if chosen not in by_id:
                log.error("router %s chose %r, not a replica", type(self.policy).__name__, chosen)
                return [candidate_replicas]
            self.decided[key] = chosen
        return [[by_id[chosen]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self.decided.pop(pending_request.metadata.internal_request_id, None)
        self.outstanding[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        self.decided.pop(internal_request_id, None)
        rid = replica_id.unique_id
        self.outstanding[rid] = max(0, self.outstanding[rid] - 1)

    def on_replica_actor_died(self, replica_id) -> None:
        self.outstanding.pop(replica_id.unique_id, None)
        super().on_replica_actor_died(replica_id)


def request_router_class():
    """Ray Serve's `RequestRouter` with jitney's routing plugged in (imported by Ray by its path). Not with
    Ray's `FIFOMixin`: that hands the replica found for one request to the oldest one waiting, and a placement
    by prefix is only right for the request it was chosen for."""
    from ray.serve.request_router import RequestRouter

    return type("JitneyRequestRouter", (_RouterMethods, RequestRouter), {"__module__": __name__})


def __getattr__(name: str):
    # Ray imports the router by its dotted path in each process that routes: built there, on demand.
    if name == "JitneyRequestRouter":
        cls = request_router_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# -- the replicas -------------------------------------------------------------------------------------------


class EngineReplica:
    """One jitney engine in a Ray Serve replica, entered for the replica's lifetime."""

    async def __init__(self, model: str, config: dict, threads: int):
        import torch
        from ray import serve

        from jitney import Engine, EngineConfig
        from jitney.plugins.metrics import PrometheusMetrics

        torch.set_num_threads(threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = PrometheusMetrics()
        self.engine = Engine.from_pretrained(model, config=EngineConfig(**config), plugins=[self.metrics])
        self._stop = asyncio.Event()
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(ready))
        await ready  # (raises what entering raised: a model refused at start-up fails the replica)

    async def _run(self, ready: asyncio.Future) -> None:
        try:
            async with self.engine:
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    async def generate(self, job: Job):
        """The request's stream: `Placed` (with the first token), the other tokens, then its `Completion`."""
        stream = self.engine.stream(job.request())
        placed = False
        async with stream:
            try:
                async for token in stream:
                    yield token if placed else Placed(self.replica_id, token)
                    placed = True
            except RequestError:
                pass  # (its completion says why)
            if not placed:
                yield Placed(self.replica_id, None)
            yield stream.completion()

    def record_routing_stats(self) -> dict:
        return {"running": len(self.engine.active), "waiting": len(self.engine.waiting)}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the engine's step loop is not running")

    def metrics_text(self) -> tuple[str, str]:
        return self.replica_id, self.metrics.render().decode()

    async def __del__(self):
        self._stop.set()
        await self._task


# -- the gateway --------------------------------------------------------------------------------------------


class RemoteStream:
    """A request served by a replica, as `serve/app.py` reads a `TokenStream`: an async iterator of `Token`s
    and an async context manager, with `completion()` at the end, and `headers` naming the replica."""

    def __init__(self, handle, job: Job, streams: Counter | None = None):
        self.handle, self.job = handle, job
        self.streams = streams if streams is not None else Counter()  # the gateway's count of open streams
        self.request_id = job.routed.request_id
        self.headers: dict[str, str] = {}
        self._gen = None
        self._next: Token | None = None
        self._tokens: dict[int, list[Token]] = {}
        self._completion: Completion | None = None

    async def place(self) -> "RemoteStream":
        """Offer the request to replicas until one sends its first token (or it ends)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError

        for _ in range(PLACEMENT_TRIES):
            self._gen = self.handle.options(stream=True).generate.remote(self.job)
            try:
                placed = await self._gen.__anext__()
            except BackPressureError:
                raise ApiError(429, "every replica is at capacity; retry later", kind="rate_limit_exceeded") from None
            except RayActorError:  # the replica died before the request started: nothing was sent yet
                log.warning("replica died before %s started; placing it again", self.request_id)
                continue
            except Exception as exc:
                raise _api_error(exc) from None
            self.headers = {REPLICA_HEADER: placed.replica_id}
            self._next = placed.token
            self.streams["open"] += 1
            return self
        raise ApiError(503, "no replica could serve the request; retry later", kind="service_unavailable")

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> Token:
        if self._next is not None:
            token, self._next = self._next, None
            return self._keep(token)
        if self._completion is not None:
            raise StopAsyncIteration
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            self._completion = self._ended("the replica's stream ended without its completion")
            raise RequestError(f"request {self.request_id} failed: {self._completion.error}") from None
        except Exception as exc:  # the replica died mid-stream
            self._completion = self._ended(f"the replica serving it failed: {type(exc).__name__}")
            raise RequestError(f"request {self.request_id} failed: {self._completion.error}") from None
        if isinstance(item, Completion):
            self._completion = item
            if item.error:
                raise RequestError(f"request {self.request_id} failed: {item.error}")
            raise StopAsyncIteration
        return self._keep(item)

    def _keep(self, token: Token) -> Token:
        self._tokens.setdefault(token.index, []).append(token)
        return token

    def _ended(self, why: str) -> Completion:
        """What a request cut off mid-stream produced, failed with `why`."""
        samples = [Sample(i, [t.token_id for t in ts], "".join(t.text for t in ts), "error")
                   for i, ts in sorted(self._tokens.items())] or [Sample(0, [], "", "error")]
        ids = self.job.routed.prompt_ids
        return Completion(self.request_id, ids, ids, samples, error=why)

    async def __aenter__(self) -> "RemoteStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._gen is not None:
            self.streams["open"] -= 1
            if self._completion is None:
                self._gen.cancel()  # (the replica's generator is cancelled: its engine aborts the request)
            self._gen = None

    def completion(self) -> Completion:
        if self._completion is None:
            raise RuntimeError("the request has not finished")
        return self._completion


def _api_error(exc: Exception) -> ApiError:
    """What a replica's refusal of a request answers (its engine's ValueError: 400)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return ApiError(400, str(cause))
    return ApiError(500, f"internal error: {type(cause or exc).__name__}", kind="server_error")


class RemoteEngine:
    """What `serve/app.py` needs of an engine, in the gateway: the model's tokenizer and limits, and `stream`,
    which places a request on a replica. The queue lives in the replicas (Ray Serve's `max_queued_requests`
    answers 429 past it)."""

    def __init__(self, handle, model: str, block_size: int):
        from transformers import AutoConfig

        from jitney.core.models import checkpoint_path, load_tokenizer

        self.handle, self.block_size = handle, block_size
        self.tokenizer = load_tokenizer(model)
        mc = AutoConfig.from_pretrained(checkpoint_path(model)).get_text_config()
        self.vocab_size = mc.vocab_size
        self.max_context = getattr(mc, "max_position_embeddings", None) or float("inf")
        self.waiting: list = []
        self.healthy = True  # False once draining: new requests and /health get 503
        self.streams: Counter = Counter()  # "open": requests placed and not yet answered in full

    async def stream(self, request: Request) -> RemoteStream:
        """`request` (its prompt as token ids, as the server gives it) placed on a replica; the replica's engine
        checks it as a local engine would (a ValueError from there answers 400)."""
        ids = list(request.prompt)
        routed = RoutedRequest.of(request.request_id, ids, self.block_size, request.metadata)
        return await RemoteStream(self.handle, Job(routed, request.params, request.metadata), self.streams).place()

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests (503) and wait up to `grace_s` for the open ones to end; how many were left."""
        self.healthy = False
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.streams["open"] > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        return self.streams["open"]

    async def render(self) -> bytes:
        """Every replica's Prometheus series, each labelled with its replica."""
        results = await asyncio.to_thread(lambda: self.handle.broadcast("metrics_text").results())
        return b"".join(_labelled(text, rid).encode() for rid, text in sorted(results))

    async def __aenter__(self) -> "RemoteEngine":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.healthy = False


def _labelled(text: str, replica_id: str) -> str:
    """Prometheus text with ``replica="<id>"`` added to every sample line."""
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition(" ")
            if "{" in name:
                name = name.replace("{", f'{{replica="{replica_id}",', 1)
            else:
                name = f'{name}{{replica="{replica_id}"}}'
            line = f"{name} {rest}"
        out.append(line)
    return "\n".join(out) + "\n"


class Gateway:
    """The ingress deployment: `serve/app.py`'s OpenAI API over a `RemoteEngine`."""

    def __init__(self, replicas, model: str, name: str, block_size: int, api_key: str | None, max_waiting: int,
                 max_n: int):
        self.args = (replicas, model, name, block_size, api_key, max_waiting, max_n)

    def __serve_build_asgi_app__(self):
        from jitney.serve.app import build_app

        replicas, model, name, block_size, api_key, max_waiting, max_n = self.args
        self.remote = RemoteEngine(replicas, model, block_size)
        return build_app(self.remote, name, self.remote, api_key=api_key, max_waiting=max_waiting, max_n=max_n)

    async def drain(self, grace_s: float) -> int:
        """Called on shutdown, before the replicas stop: see `RemoteEngine.drain`."""
        return await self.remote.drain(grace_s)


# -- running it ---------------------------------------------------------------------------------------------


@dataclass
class Fleet:
    """How to run N replicas."""

    model: str
    replicas: int = 2
    router: str = "prefix_affinity"
    engine: dict = field(default_factory=dict)
    """`EngineConfig` fields for every replica."""
    api_key: str | None = None
    max_waiting: int = 256
    max_n: int = 16
    grace_s: float = 30.0
    """On shutdown, how long running requests may take to finish."""
    threads: int | None = None
    """Torch threads per replica (default: the machine's cores shared among the replicas)."""


def application(fleet: Fleet):
    """The Ray Serve application of `fleet` (`serve.run` it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from jitney.core.hooks import make_plugin_manager, registry

    registry(make_plugin_manager(), "router").create(fleet.router, RouterConfig())  # an unknown name fails here
    block_size = fleet.engine.get("block_size", 16)
    threads = fleet.threads or max(1, (os.cpu_count() or 1) // fleet.replicas)
    engine = dict(fleet.engine)
    if engine.get("num_blocks") is None:  # the replicas share the machine's memory
        engine["max_memory_percent"] = engine.get("max_memory_percent", 0.9) / fleet.replicas
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=fleet.replicas,
        ray_actor_options={"num_cpus": 0},  # (threads are set by hand: Ray's CPU count must not hold replicas back)
        max_ongoing_requests=fleet.max_waiting + engine.get("max_requests_per_batch", 256),
        max_queued_requests=fleet.max_waiting, graceful_shutdown_timeout_s=fleet.grace_s,
        health_check_period_s=2, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=f"{__name__}.JitneyRequestRouter",
            request_router_kwargs={"router": fleet.router, "block_size": block_size},
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5),
    )
    gateway = serve.deployment(serve.ingress()(Gateway), name="Gateway", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000, graceful_shutdown_timeout_s=fleet.grace_s)
    name = fleet.model if fleet.model == "smollm2" else os.path.basename(os.path.normpath(fleet.model))
    return gateway.bind(replica.bind(fleet.model, engine, threads), fleet.model, name, block_size, fleet.api_key,
                        fleet.max_waiting, fleet.max_n)


def _await_every_replica(url: str, fleet: Fleet, timeout_s: float = 120.0) -> None:
    """Wait until the gateway's handle knows every replica (its /metrics gathers from each): a fresh gateway
    first sees the replica that started first, and its router would place every request there."""
    import time

    import httpx

    headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
        except httpx.HTTPError:
            text = ""
        if len({line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                if 'replica="' in line}) >= fleet.replicas:
            return
        time.sleep(0.2)
    log.warning("the gateway did not see all %d replicas within %.0f s", fleet.replicas, timeout_s)


def serve_fleet(fleet: Fleet, host: str, port: int, address: str | None = None) -> None:
    """Serve `fleet` until SIGTERM or Ctrl-C, then drain: running requests get `grace_s` to finish, new ones
    get 503. Without `address` a local Ray instance is started and stopped with it; with one (``auto``,
    ``ray://...``) it joins that cluster."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("serving several replicas needs Ray Serve: pip install 'jitney[cluster]'") from None

    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    gateway = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        gateway = serve.run(application(fleet), name="jitney", route_prefix="/")
        _await_every_replica(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}", fleet)
        print(f"jitney: {fleet.replicas} replicas of {fleet.model} on http://{host}:{port} (router {fleet.router})",
              flush=True)
        stop.wait()
    finally:
        try:  # new requests get 503 at once; running ones have grace_s to finish
            left = gateway.drain.remote(fleet.grace_s).result(timeout_s=fleet.grace_s + 10) if gateway else 0
            if left:
                log.warning("%d requests were still running after %.0f s: they end now", left, fleet.grace_s)
        except Exception:
            log.exception("draining the gateway failed")
        serve.shutdown()
        if address is None:
            ray.shutdown()

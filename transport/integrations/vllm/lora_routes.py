"""The server side of LoRA adapters over HTTP: routes that install a version of an adapter in
every worker and serve it under its name, added to vLLM's API server as an ASGI middleware
(``vllm serve ... --middleware transport.integrations.vllm.lora_routes.AdapterRoutes``).

vLLM's own ``/v1/load_lora_adapter`` reads a folder and gives the adapter an id of its own
choosing; these routes instead have the workers install the version they received through
transport (modes/lora.py, through the worker extension:
``--worker-extension-cls transport.integrations.vllm.extension.TransportState``) and then name
the adapter in the server's table of adapters under the id every worker installed it under
(lora_spec.adapter_id), so ``{"model": "<adapter>"}`` in a completion request is served by it.

* ``POST /transport/adapters/init`` (the adapter's init info, with its proof): every worker
  joins the adapter's group (a no-op where nothing changed).
* ``POST /transport/adapters/install`` ``{"adapter", "namespace", "version", "timeout",
  "proof"}``: pauses scheduling until the requests running finish (vLLM's pause, mode
  ``wait``: a request is served by one version from its first token to its last), installs the
  version in every worker, names the adapter, resets the prefix cache (blocks of the previous
  version's keys and values), resumes. Concurrent installs share one pause. With
  ``"as_model": true`` the adapter is also served under the base model's own name(s): a request
  for the model gets the adapter (what an RL rollout that names the model wants, TRL's among
  them); an install without it gives the model's name back to the base model.
* ``POST /transport/adapters/remove`` ``{"adapter", "namespace", "proof"}``: the name first
  (new requests for it are refused), then the workers' copy, while paused.

**Who may.** Where the namespace has a secret in the server's environment
(setup.secret_from_env), ``proof`` must be :func:`proof` of the request under that secret: a
caller without it cannot install, rename or remove a tenant's adapter. A name served by one
namespace (or loaded from a folder) is refused to another until it is removed. The weights
themselves only ever come from the namespace's publishers (the workers' groups). Only one
namespace may serve an adapter under the model's name, so that one tenant cannot take every
other tenant's base model: ``default``, or the one the server names in
``$TRANSPORT_MODEL_NAMESPACE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from transport import RouteError
from transport.integrations.setup import secret_from_env
from transport.integrations.vllm.lora_spec import adapter_id, check_proof

log = logging.getLogger(__name__)

#: the routes' common prefix
PREFIX = "/transport/adapters/"
#: the routes, after PREFIX
ACTIONS = ("init", "install", "remove")
#: the largest request body the routes read
MAX_BODY = 4096
#: the server's environment variable naming the namespace that may serve an adapter under the
#: base model's name (default: "default")
MODEL_NAMESPACE_ENV = "TRANSPORT_MODEL_NAMESPACE"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class AdapterCall:
    """One request to the routes, checked."""

    action: str
    adapter: str
    namespace: str
    version: int
    timeout: float
    proof: str
    as_model: bool = False

    @classmethod
    def parse(cls, action: str, body: bytes) -> AdapterCall:
        try:
            data = json.loads(body)
        except ValueError as e:
            raise RouteError(400, f"the body is not JSON ({e})") from e
        if not isinstance(data, dict):
            raise RouteError(400, "the body is a JSON object")
        adapter, namespace = data.get("adapter"), data.get("namespace", "default")
        version, timeout = data.get("version", 0), data.get("timeout", 60.0)
        given, as_model = data.get("proof", ""), data.get("as_model", False)
        if not isinstance(adapter, str) or not adapter or not isinstance(namespace, str):
            raise RouteError(400, "adapter and namespace are non-empty strings")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RouteError(400, "version is an int >= 0")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise RouteError(400, "timeout is a number of seconds > 0")
        if not isinstance(given, str):
            raise RouteError(400, "proof is a string")
        if not isinstance(as_model, bool):
            raise RouteError(400, "as_model is true or false")
        return cls(action, adapter, namespace, version, float(timeout), given, as_model)

    def check(self) -> None:
        """RouteError 403 unless the proof is right for the namespace's secret (if any)."""
        with _forbidden():
            check_proof(
                secret_from_env(self.namespace),
                self.proof,
                f"{self.action} of adapter {self.adapter!r} of namespace {self.namespace}",
                *self.fields(),
            )

    def fields(self) -> tuple[Any, ...]:
        return install_fields(
            self.action, self.namespace, self.adapter, self.version, self.as_model
        )

    def check_model_namespace(self) -> None:
        """RouteError 403 if this call would serve its adapter under the model's name from a
        namespace the server does not allow to."""
        allowed = os.environ.get(MODEL_NAMESPACE_ENV) or "default"
        if self.as_model and self.namespace != allowed:
            raise RouteError(
                403,
                f"only namespace {allowed!r} may serve an adapter under the model's name (the "
                f"server's ${MODEL_NAMESPACE_ENV}); namespace {self.namespace!r} serves "
                f"{self.adapter!r} under its own name",
            )


def install_fields(
    action: str, namespace: str, adapter: str, version: int, as_model: bool = False
) -> tuple[Any, ...]:
    """What the proof of an install or a removal covers (lora_spec.proof)."""
    fields: tuple[Any, ...] = (action, namespace, adapter, version)
    return (*fields, "as_model") if as_model else fields


class AdapterRoutes:
    """The ASGI middleware: it answers the routes under :data:`PREFIX` and passes every other
    request to vLLM's app. It owns the pause it shares among concurrent installs (vLLM's pause
    is one flag: the first install pauses, the last resumes)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self._users = 0
        self._gate = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        action = path[len(PREFIX) :]
        try:
            if scope.get("method") != "POST" or action not in ACTIONS:
                raise RouteError(404, f"the routes are POST {PREFIX}{{{','.join(ACTIONS)}}}")
            body = await _body(receive)
            if action == "init":
                info = _checked_init(body)  # before anything of vLLM's is touched
                result: dict[str, Any] = await self.init(scope["app"].state, info)
            else:
                call = AdapterCall.parse(action, body)
                call.check()
                call.check_model_namespace()
                if action == "install":
                    result = await self.install(scope["app"].state, call)
                else:
                    result = await self.remove(scope["app"].state, call)
            status = 200
        except RouteError as e:
            status, result = e.status, {"error": str(e)}
        except Exception as e:  # a worker's refusal, named
            log.warning("transport adapter route %s failed: %s", path, e)
            status, result = 500, {"error": f"{type(e).__name__}: {e}"}
        await _respond(send, status, result)

    async def init(self, state: Any, info: Any) -> dict[str, Any]:
        """Every worker joins the adapter (its checked init info: TransportInitInfo)."""
        payload = dataclasses.asdict(info)
        results = await _workers(state, "init", payload, info.timeout + 30)
        return {"joined": [r["joined"] for r in results]}

    async def install(self, state: Any, call: AdapterCall) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        engine, models = state.engine_client, state.openai_serving_models
        lora_id = adapter_id(call.namespace, call.adapter)
        names = _served_names(models, call)
        for name in names:
            _check_name(models, call, lora_id, name)
        update = {
            "adapter": call.adapter,
            "namespace": call.namespace,
            "version": call.version,
            "timeout": call.timeout,
        }
        async with self._paused(engine):
            results = await _workers(state, "install", update, call.timeout + 30)
            for name in names:  # another namespace may have taken one meanwhile
                _check_name(models, call, lora_id, name)
            request = LoRARequest(
                lora_name=call.adapter,
                lora_int_id=lora_id,
                lora_path=f"/transport/{call.namespace}/{call.adapter}",
            )
            _unbind(models, lora_id)  # the model's names, if this adapter held them
            for name in names:
                models.lora_requests[name] = request
            await engine.reset_prefix_cache()
        return {"installed": [r["version"] for r in results], "lora_id": lora_id}

    async def remove(self, state: Any, call: AdapterCall) -> dict[str, Any]:
        engine, models = state.engine_client, state.openai_serving_models
        lora_id = adapter_id(call.namespace, call.adapter)
        _check_name(models, call, lora_id, call.adapter)
        _unbind(models, lora_id)
        payload = {"namespace": call.namespace, "adapter": call.adapter}
        async with self._paused(engine):
            results = await _workers(state, "remove", payload, 60)
        return {"removed": [r["removed"] for r in results]}

    @contextlib.asynccontextmanager
    async def _paused(self, engine: Any) -> AsyncIterator[None]:
        """vLLM paused (running requests finished first) while the block runs; shared."""
        async with self._gate:
            if self._users == 0:
                await engine.pause_generation(mode="wait", clear_cache=False)
            self._users += 1
        try:
            yield
        finally:
            async with self._gate:
                self._users -= 1
                if self._users == 0:
                    await engine.resume_generation()


@contextlib.contextmanager
def _forbidden() -> Iterator[None]:
    """A proof that fails (PermissionError) as RouteError 403."""
    try:
        yield
    except PermissionError as e:
        raise RouteError(403, str(e)) from e


def _checked_init(body: bytes) -> Any:
    """The init info of an adapter in ``body``, its proof checked (RouteError 400 or 403)."""
    from transport.integrations.vllm.infos import TransportInitInfo, parse

    try:
        info = parse(TransportInitInfo, json.loads(body), "init_info")
    except ValueError as e:
        raise RouteError(400, str(e)) from e
    if info.adapter is None:
        raise RouteError(400, "transport init_info: name the adapter to join")
    with _forbidden():
        info.check_proof()
    return info


async def _workers(
    state: Any, action: str, payload: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    """Every worker's answer to extension.adapter_call; RouteError 500 naming what failed."""
    from transport.integrations.vllm.extension import adapter_results

    results = await state.engine_client.collective_rpc(
        "transport_adapter", timeout=timeout, args=(action, payload)
    )
    try:
        return adapter_results(list(results), f"the adapter {action} of {payload.get('adapter')!r}")
    except RuntimeError as e:
        raise RouteError(500, str(e)) from e


def _served_names(models: Any, call: AdapterCall) -> list[str]:
    """The names an install serves its adapter under: its own, and the base model's with
    ``as_model``."""
    names = [call.adapter]
    if call.as_model:
        names += [p.name for p in models.base_model_paths if p.name != call.adapter]
    return names


def _check_name(models: Any, call: AdapterCall, lora_id: int, name: str) -> None:
    bound = models.lora_requests.get(name)
    if bound is not None and bound.lora_int_id != lora_id:
        raise RouteError(
            409,
            f"name {name!r} is served by another adapter, namespace or folder "
            f"({bound.lora_path}); remove it there first, or choose another name",
        )


def _unbind(models: Any, lora_id: int) -> None:
    """Every name that serves the adapter ``lora_id`` stops serving it."""
    for name in [n for n, r in models.lora_requests.items() if r.lora_int_id == lora_id]:
        del models.lora_requests[name]


async def _body(receive: Receive) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise RouteError(413, f"the body is larger than {MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})

"""Processes of the vLLM tests: a vLLM engine (offline ``LLM``, its worker in the same process)
with the ``transport`` weight-transfer backend, trainers publishing the small models' versions
(one rank holding every tensor, the ranks of a sharded trainer, a plain WeightPublisher, or the
``transport`` trainer engine over HTTP). All are children driven over a pipe (helpers.child)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from helpers import internals
from helpers.child import ChildProcess, serve
from helpers.llama import NEW_TOKENS, PROMPTS, set_version

#: what vLLM's CPU build needs here: a small KV cache, everything in the engine's process
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def init_info(store_url: str, group: str, **extra: Any) -> dict[str, Any]:
    """A worker's init_info for ``group`` of the store at ``store_url`` (30 s to join)."""
    return {"store": store_url, "group": group, "timeout": 30, **extra}


def send_on_both_ranks(rank0: Any, rank1: Any, version: int) -> tuple[dict[str, str], Any]:
    """Both ranks of a two-rank ShardedTrainer send ``version`` at once; rank 0's (publish
    status, vLLM's tokens). Rank 1 must see the same status, and hosts no engine."""
    rank1.begin("send", version)
    status, tokens = rank0.call("send", version, timeout=120)
    status1, none = rank1.end("send", 120)
    assert status1 == status and none is None, (status1, status)
    return status, tokens


def send_counting(
    trainer: Any, version: int
) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """An HttpTrainer's ``send``: (status, reasons, bytes written to each worker meanwhile)."""
    before = trainer.call("traffic")
    status, reasons = trainer.call("send", version, timeout=180)
    after = trainer.call("traffic")
    return status, reasons, {n: after.get(n, 0) - before.get(n, 0) for n in status}


def llm_kwargs(model_dir: Path | str) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 128,
        "block_size": 32,
        "seed": 0,
        "skip_tokenizer_init": True,
        "weight_transfer_config": {"backend": "transport"},
    }


def compute_as_stored() -> None:
    """From now on (before the engine loads its model) vLLM's CPU build computes every linear
    layer with its parameter as stored, as vLLM's GPU builds do, instead of a copy packed for
    oneDNN: the models of this process can then be written in place (integrations/vllm/as_stored.py).
    Other processes: ``AS_STORED_PATH`` on their PYTHONPATH."""
    from vllm.model_executor.layers import utils

    from helpers.as_stored.sitecustomize import patch

    patch(utils)


#: a folder that, on a process's PYTHONPATH, does what compute_as_stored does in every process
#: that imports vLLM (a server and its workers)
AS_STORED_PATH = Path(__file__).parent / "as_stored"


def _vllm_child(conn: Any, name: str, model_dir: str, as_stored: bool) -> None:
    os.environ.update(VLLM_ENV)
    try:
        from vllm import LLM, SamplingParams

        if as_stored:
            compute_as_stored()

        llm = LLM(**llm_kwargs(model_dir))
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))

    def generate() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def init(info: dict[str, Any]) -> None:
        llm.init_weight_transfer_engine({"init_info": info})

    def update(update_info: dict[str, Any]) -> str:
        """The four phases as a framework drives them; the weight version vLLM reports after."""
        llm.start_weight_update()
        llm.update_weights({"update_info": update_info})  # raises: vLLM ends the update itself
        version = update_info.get("version")
        try:  # the version loads here, with the version vLLM reports
            llm.finish_weight_update(None if version is None else str(version))
        except BaseException:
            # vLLM keeps an update whose finish failed open: close it (it loads nothing now)
            llm.finish_weight_update(None)
            raise
        llm.reset_prefix_cache()
        return llm.get_weight_version()

    def update_unfinished(update_info: dict[str, Any]) -> None:
        """Start and update, never finish: what vLLM sees of a trainer that dies between its
        update and finish calls."""
        llm.start_weight_update()
        llm.update_weights({"update_info": update_info})

    def engine_state() -> list[dict[str, Any]]:
        """Each worker's engine: the version its model holds, its subscriber's newest complete
        and incomplete version, its peer name."""
        return llm.collective_rpc(_engine_state)

    def param(name: str) -> list[float]:
        """The values of one parameter of vLLM's model (vLLM's name), as it holds them."""
        return llm.collective_rpc(_param, args=(name,))[0]

    def skip_tied(skip: bool) -> None:
        """Make each worker's updates leave tied parameters unloaded (as a vLLM whose loader
        skips a layer would), or load them again."""
        llm.collective_rpc(_skip_tied, args=(skip,))

    handlers = {
        "generate": generate,
        "engine_state": engine_state,
        "param": param,
        "skip_tied": skip_tied,
        "reinit_frees_staging": lambda info: llm.collective_rpc(
            _reinit_frees_staging, args=(info,)
        )[0],
        "fall_back": lambda names: llm.collective_rpc(_fall_back, args=(names,)),
        "init": init,
        "update": update,
        "update_unfinished": update_unfinished,
        "start": llm.start_weight_update,
        "finish": llm.finish_weight_update,
        "update_only": lambda info: llm.update_weights({"update_info": info}),
        "weight_version": llm.get_weight_version,
        "shutdown_engine": llm.shutdown_weight_transfer_engine,
    }
    serve(conn, handlers, llm.shutdown_weight_transfer_engine)


def _engine_state(worker: Any) -> dict[str, Any]:
    """The worker engine's state (EngineState), with ``loaded`` (the version the model holds)
    and ``name`` (its peer name) as the tests name them."""
    import dataclasses

    state = dataclasses.asdict(getattr(worker, "worker", worker).weight_transfer_engine.state())
    return {**state, "loaded": state["version"], "name": state["peer"]}


def _skip_tied(worker: Any, skip: bool) -> None:
    from transport.integrations.vllm import reload
    from transport.integrations.vllm.modes import loading as module

    def direct_but_head(model: Any, targets: dict[str, Any], tensors: Any) -> None:
        """The sharded mode's load, but the output head (tied to the embedding) takes nothing."""
        kept = {
            n: replace(t, holders=tuple(h for h in t.holders if not h.startswith("lm_head")))
            for n, t in targets.items()
        }
        reload.load_direct(model, kept, tensors)

    module.load_tied = (lambda *args: None) if skip else reload.load_tied  # type: ignore[assignment]
    module.load_direct = direct_but_head if skip else reload.load_direct  # type: ignore[assignment]


def _fall_back(worker: Any, names: list[str]) -> None:
    """From the next init on, the worker's layout takes checkpoint tensors ``names`` whole, for
    vLLM's loader, as if the replay could not map them (and whatever shares a parameter with
    them, by the layout's own rule)."""
    from transport.integrations.vllm import shards
    from transport.integrations.vllm.modes import choice as module

    def learn(model: Any, spec: Any) -> Any:
        reasons = dict.fromkeys(names, "the test asked for it")
        return shards.fall_back(shards.learn(model, spec), spec, reasons)

    module.learn = learn if names else shards.learn  # type: ignore[assignment]


def _reinit_frees_staging(worker: Any, info: dict[str, Any]) -> bool:
    """Whether the staging memory of the worker's group is freed by an init into another
    group, before that init returns (weak references to its flat buffers die)."""
    engine = getattr(worker, "worker", worker).weight_transfer_engine
    refs = internals.staging_buffers(engine.subscriber)
    engine.init_transfer_engine(engine.parse_init_info(info))
    return bool(refs) and all(r() is None for r in refs)


def _param(worker: Any, name: str) -> list[float]:
    model = getattr(worker, "worker", worker).model_runner.get_model()
    return model.get_parameter(name).detach().flatten().tolist()


class VllmProcess(ChildProcess):
    """vLLM serving the model in ``model_dir``. Commands: ``generate`` (greedy tokens of every
    prompt of helpers.llama.PROMPTS), ``init(init_info)``, ``update(update_info)`` (start,
    update, finish with the version's name, prefix cache reset; returns the weight version),
    ``weight_version``, ``engine_state``, ``param(name)``, ``skip_tied(bool)``,
    ``shutdown_engine``, ``reinit_frees_staging(init_info)``, ``fall_back(names)`` (from the next init, those checkpoint tensors
    travel whole, through vLLM's loader); one phase at a time: ``start``, ``update_only(update_info)``,
    ``finish(weight_version)``, ``update_unfinished(update_info)`` (start and update).
    ``as_stored``: the engine computes with its parameters as stored (compute_as_stored)."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(
        self, name: str, model_dir: Path, start_timeout: float = 180, as_stored: bool = False
    ) -> None:
        super().__init__(name, _vllm_child, (str(model_dir), as_stored), start_timeout)


def _pub_child(
    conn: Any,
    name: str,
    store: str,
    model_dir: str,
    group: str,
    mangle: str | None,
    plain: bool,
    parts: int,
    kwargs: dict[str, Any],
) -> None:
    import torch
    from safetensors.torch import load_file

    import transport
    from transport.integrations.vllm.modes.streamed import part_group
    from transport.weights import ShardedPublisher, SourceLayout

    try:
        t = transport.Transport(name, store=store, **kwargs)
        # the checkpoint's tensors (names, shapes, dtypes), read without importing transformers
        state = load_file(str(Path(model_dir) / "model.safetensors"))
        if mangle == "shape":  # a trainer of another model: one tensor of another shape
            state["model.norm.weight"] = state["model.norm.weight"].new_zeros(65)
        elif mangle == "names":  # a checkpoint renamed: the model's name is missing
            state["model.final_norm.weight"] = state.pop("model.norm.weight")
        elif mangle == "bfloat16":  # a trainer that publishes in another dtype than vLLM's
            state = {n: t.to(torch.bfloat16) for n, t in state.items()}
        if plain:  # relays and whole checkpoints (workers in the whole mode)
            pub = transport.WeightPublisher(t, state, group=group)
        else:  # writes each worker only what it keeps, as the trainer engine does
            pub = ShardedPublisher(t, state, SourceLayout.single(state), 0, group=group)
        # the further parts of a streamed version, each a group of its own
        pubs = [pub] + [
            ShardedPublisher(t, state, SourceLayout.single(state), 0, group=part_group(group, k))
            for k in range(1, parts)
        ]
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def publish(version: int, timeout: float) -> tuple[dict[str, str], dict[str, str]]:
        """Every part's group; the status of each worker in every part (the worst of them),
        and the reasons of all."""
        set_version(state, version)
        handles = [p.publish(version, timeout=timeout) for p in pubs]
        status: dict[str, str] = {}
        reasons: dict[str, str] = {}
        for h in handles:
            r = h.wait(timeout + 30)
            for peer, s in r.status.items():
                status[peer] = s if status.get(peer, "done") == "done" else status[peer]
            reasons.update(r.reasons)
        return status, reasons

    def publish_nowait(version: int, timeout: float) -> None:
        set_version(state, version)
        for p in pubs:
            p.publish(version, timeout=timeout)

    handlers = {
        "publish": publish,
        "publish_nowait": publish_nowait,
        # data goes, a version's completion never does (the test kills this process)
        "hold_notified_parts": lambda let_through=0: (
            internals.hold_notified_posts(t)
            if plain
            else internals.hold_completions(t, let_through=let_through)
        ),
        "subscribers": pub.subscribers,
    }
    serve(conn, handlers, lambda: ([p.close() for p in pubs], t.close()))


class LlamaPublisher(ChildProcess):
    """A trainer publishing versions (helpers.llama.set_version) of the small Llama saved in
    ``model_dir`` to ``group``, as one rank holding every tensor whole (a ShardedPublisher:
    each worker gets only what it keeps), or with a plain WeightPublisher (``plain``: whole
    checkpoints, for workers in the whole mode). ``mangle``: "shape" or "names" publishes a state dict that does not
    match the model; "bfloat16" publishes the same tensors in bfloat16. ``parts``: the groups of
    a streamed version it publishes too (integrations/vllm/streamed.py). Commands:
    ``publish(version, timeout)`` -> (status, reasons), ``publish_nowait``,
    ``hold_notified_parts(let_through=0)``, ``subscribers``."""

    def __init__(
        self,
        name: str,
        store_url: str,
        model_dir: Path,
        group: str = "policy",
        mangle: str | None = None,
        start_timeout: float = 60,
        plain: bool = False,
        parts: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            name,
            _pub_child,
            (store_url, str(model_dir), group, mangle, plain, parts, kwargs),
            start_timeout,
        )


def _trainer_child(conn: Any, name: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    try:  # the imports first (seconds): the test starts this child while the server starts
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from helpers.llama import checkpoint_tensors, hf_model
        from transport.integrations.vllm import register
        from transport.integrations.vllm.trainer import HTTPClient, TransportTrainerInitInfo

        register()  # a trainer runs no vLLM engine, so vLLM's plugins are not loaded here
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))
    engines: list[Any] = []
    models: list[Any] = []
    saved: list[dict[str, Any] | None] = []  # per engine: its source under checkpoint names

    def connect(
        url: str,
        store: str,
        namespace: str,
        kwargs: dict[str, Any],
        kind: str = "llama",
        names: str = "model",
    ) -> None:
        """``names="checkpoint"``: the source is a mapping of the model's tensors under the
        names its saved checkpoint holds (one tensor per expert matrix), refreshed each send."""
        models.append(hf_model(0, kind=kind))
        source: Any = ModuleSource(models[-1])
        saved.append(None)
        if names == "checkpoint":
            saved[-1] = source = checkpoint_tensors(models[-1], models[-1].state_dict())
        info = TransportTrainerInitInfo(store, namespace=namespace, name=name, rank=0, **kwargs)
        engines.append(
            WeightTransferTrainerFactory.trainer_init(info, client=HTTPClient(url), source=source)
        )

    def set_source(version: int) -> None:
        set_version(models[-1].state_dict(), version)  # the module's parameters, in place
        if saved[-1] is not None:
            for n, x in checkpoint_tensors(models[-1], models[-1].state_dict()).items():
                saved[-1][n].copy_(x)

    patched: dict[str, int] = {}  # of the last send or publish: who took changes, bytes

    def send(version: int) -> tuple[dict[str, str], dict[str, str]]:
        set_source(version)
        r = engines[-1].send_weights(version)
        patched.clear()
        patched.update(r.patched)
        return dict(r.status), dict(r.reasons)

    def publish(version: int, timeout: float = 30.0) -> tuple[dict[str, str], dict[str, str]]:
        """Publish only: vLLM is not asked to load it."""
        set_source(version)
        r = engines[-1].publisher.publish(version, timeout=timeout).wait(timeout + 30)
        patched.clear()
        patched.update(r.patched)
        return dict(r.status), dict(r.reasons)

    def traffic() -> dict[str, int]:
        return {n: x.written for n, x in engines[-1].transport.traffic().items()}

    handlers = {
        "connect": connect,
        "send": send,
        "publish": publish,
        "traffic": traffic,
        "patched": lambda: dict(patched),
    }
    serve(conn, handlers, lambda: [e.shutdown() for e in engines])


class HttpTrainer(ChildProcess):
    """A trainer driving a vLLM server with the ``transport`` trainer engine, found by name in
    vLLM's WeightTransferTrainerFactory, over vLLM's HTTP client. ``env`` is set in the child
    first. Commands: ``connect(url, store_url, namespace, init_kwargs, kind, names)``
    (trainer_init of the test model ``kind``; its source named as in memory, or ``names=
    "checkpoint"`` as its saved checkpoint), ``send(version)`` (sets the model's parameters to that version and
    sends them; returns the publish's (status, reasons)), ``publish(version)`` (only publishes),
    ``traffic`` (bytes written to each peer so far), ``patched`` (of the last send or publish:
    the workers that took the version as changes, and the bytes written to each)."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        start_timeout: float = 120,
        wait: bool = True,
    ) -> None:
        super().__init__(name, _trainer_child, (env or {},), start_timeout, wait)


def _llama_shards(model_dir: str, world: int, rank: int) -> tuple[Any, Any, Any]:
    """(the checkpoint's tensors, their SourceLayout, a function giving ``rank``'s shards of a
    state): column-parallel matrices along dim 0, row-parallel ones (o_proj, down_proj) along
    dim 1, norms replicated, as a tensor-parallel trainer holds the checkpoint."""
    from safetensors.torch import load_file

    from transport.weights import SourceLayout

    full = load_file(str(Path(model_dir) / "model.safetensors"))
    dims = {
        n: None if x.dim() == 1 else 1 if ("o_proj" in n or "down_proj" in n) else 0
        for n, x in full.items()
    }
    layout = SourceLayout.split(world, {n: (x.shape, x.dtype) for n, x in full.items()}, dims)

    def mine(state: dict[str, Any]) -> dict[str, Any]:
        return {
            n: state[n][tuple(slice(lo, hi) for lo, hi in s.held[rank].box(s.shape))].contiguous()
            for n, s in layout.tensors.items()
        }

    return full, layout, mine


def _rank_child(
    conn: Any,
    name: str,
    store: str,
    model_dir: str,
    group: str,
    world: int,
    rank: int,
    secret: str | None,
) -> None:
    import transport
    from transport.weights import ShardedPublisher

    try:
        t = transport.Transport(name, store=store, timeout=30, secret=secret)
        full, layout, mine = _llama_shards(model_dir, world, rank)
        shards = mine(full)
        pub = ShardedPublisher(t, shards, layout, rank, group=group)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def publish(version: int, timeout: float) -> tuple[dict[str, str], dict[str, str]]:
        set_version(full, version)  # the whole model's values of that version, then our part
        for n, x in mine(full).items():
            shards[n].copy_(x)
        r = pub.publish(version, timeout=timeout).wait(timeout + 30)
        return dict(r.status), dict(r.reasons)

    def traffic() -> dict[str, int]:
        return {n: x.written for n, x in t.traffic().items()}

    serve(conn, {"publish": publish, "traffic": traffic}, lambda: (pub.close(), t.close()))


class ShardedLlamaRank(ChildProcess):
    """Rank ``rank`` of a ``world``-rank trainer of the small Llama (tensor-parallel shards),
    publishing with a ShardedPublisher into vLLM's workers, with the namespace's ``secret`` if it
    has one. Commands: ``publish(version, timeout)`` -> (status, reasons), ``traffic`` (bytes
    written to each peer so far)."""

    def __init__(
        self,
        name: str,
        store_url: str,
        model_dir: Path,
        group: str,
        world: int,
        rank: int,
        wait: bool = True,
        secret: str | None = None,
    ) -> None:
        args = (store_url, str(model_dir), group, world, rank, secret)
        super().__init__(name, _rank_child, args, 60, wait)


def _sharded_trainer_child(
    conn: Any,
    name: str,
    store: str,
    model_dir: str,
    world: int,
    rank: int,
    as_stored: bool,
    kwargs: dict[str, Any],
) -> None:
    """Rank ``rank`` of a sharded trainer through vLLM's own trainer factory; rank 0 also hosts
    the vLLM engine (offline, in this process) and drives its updates."""
    os.environ.update(VLLM_ENV)
    try:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from transport.integrations.vllm import register
        from transport.integrations.vllm.trainer import OfflineClient, TransportTrainerInitInfo

        register()
        llm = params = client = None
        if rank == 0:
            from vllm import LLM, SamplingParams

            if as_stored:
                compute_as_stored()
            llm = LLM(**llm_kwargs(model_dir))
            params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
            client = OfflineClient(llm)
        full, layout, mine = _llama_shards(model_dir, world, rank)
        shards = mine(full)
        info = TransportTrainerInitInfo(
            store,
            group="sharded-trainer",
            name=name,
            timeout=30,
            layout=layout,
            rank=rank,
            **kwargs,
        )
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=shards)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))

    def send(version: int) -> tuple[dict[str, str], list[list[int]] | None]:
        set_version(full, version)
        for n, x in mine(full).items():
            shards[n].copy_(x)
        r = engine.send_weights(version)
        if llm is None:
            return dict(r.status), None
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return dict(r.status), [list(o.outputs[0].token_ids) for o in outs]

    def engine_state() -> list[dict[str, Any]]:
        assert llm is not None, "rank 0 hosts the engine"
        return llm.collective_rpc(_engine_state)

    serve(conn, {"send": send, "engine_state": engine_state}, engine.shutdown)


class ShardedTrainer(ChildProcess):
    """Rank ``rank`` of a ``world``-rank trainer using the ``transport`` trainer engine with a
    source layout (vLLM's factory, ``rank=`` and ``layout=``); rank 0 hosts an offline vLLM
    engine. Commands: ``send(version)`` -> (publish status, vLLM's tokens on rank 0),
    ``engine_state`` (rank 0). ``as_stored``: the engine computes with its parameters as
    stored (compute_as_stored); ``info`` goes into the trainer's init info (mode, staging_gb)."""

    FROM_VLLM_SERVER = True  # forks from the server that imported vLLM (helpers.child)

    def __init__(
        self,
        name: str,
        store_url: str,
        model_dir: Path,
        world: int,
        rank: int,
        wait: bool = True,
        as_stored: bool = False,
        **info: Any,
    ) -> None:
        super().__init__(
            name,
            _sharded_trainer_child,
            (store_url, str(model_dir), world, rank, as_stored, info),
            180,
            wait,
        )

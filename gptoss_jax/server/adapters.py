"""LoRA adapters served by name (`gptoss-serve --lora NAME=PATH`): the request's `model` picks one
(the base model under its own name), each in an entry of the engine's table of served adapters
(training/lora.empty_table, Engine.put_adapter).

Loading reads the folder on a worker thread and puts the adapter into a free entry; unloading
refuses new requests for the name at once (404), waits for the requests under it to end (their
replies complete), then frees the entry. Every request under an adapter holds it from its submission
to its end (`hold`, `release`); all of this state is touched on the event loop only, except the
reading and the putting, which run on workers."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from fastapi import Request as HTTPRequest

from . import body, protocol
from .errors import APIError, bad_request, model_not_found


@dataclasses.dataclass
class Named:
    """A loaded adapter: its entry of the table, where it came from, the requests under it now."""

    entry: int
    path: str
    created: int
    running: int = 0
    unloading: asyncio.Event | None = None  # set once its last request ends, while it is being unloaded


class ServedAdapters:
    """The names the server answers to: `base` (the model without adapter) and each adapter's."""

    def __init__(self, base: str, entries: int, max_rank: int, targets: tuple[str, ...]):
        self.base, self.entries, self.max_rank, self.targets = base, entries, max_rank, targets
        self.names: dict[str, Named] = {}
        self.loading: dict[str, int] = {}  # names being loaded -> the entries they will take
        self.requests: collections.Counter[str] = collections.Counter()  # requests taken, by model name

    def check(self, name: str) -> None:
        """404 for a model name this server does not answer to now (an adapter being unloaded included)."""
        if name != self.base and (name not in self.names or self.names[name].unloading is not None):
            raise model_not_found(name, self.base, list(self.serving()))

    def serving(self) -> list[str]:
        return [n for n, a in tuple(self.names.items()) if a.unloading is None]  # (a worker's 404 reads it too)

    def hold(self, name: str) -> int | None:
        """A request under `name` starts: its entry (None: the base model); 404 as `check`."""
        self.check(name)
        if name == self.base:
            return None
        self.names[name].running += 1
        return self.names[name].entry

    def release(self, name: str) -> None:
        """A request under `name` has ended (its reply given, or abandoned)."""
        named = self.names.get(name) if name != self.base else None
        if named is not None:
            named.running -= 1
            if named.running == 0 and named.unloading is not None:
                named.unloading.set()

    def free_entry(self, name: str) -> int:
        """The entry a new adapter of this name takes, reserved until `loading` forgets the name (400
        where the name is taken or no entry is free)."""
        if name == self.base or name in self.names or name in self.loading:
            raise bad_request(f"an adapter or model named {name!r} is already served; unload it first", "lora_name")
        taken = {a.entry for a in self.names.values()} | set(self.loading.values())
        free = [i for i in range(self.entries) if i not in taken]
        if not self.entries:
            raise APIError(400, "this server has no table of adapters to load into: start it with --max-loras N",
                           "invalid_request_error", "lora_name", "lora_capacity_reached")
        if not free:
            raise APIError(400, f"every one of the {self.entries} adapter entries is taken (gptoss-serve --max-loras); "
                                "unload one first", "invalid_request_error", "lora_name", "lora_capacity_reached")
        self.loading[name] = free[0]
        return free[0]

    def unloading(self, name: str) -> asyncio.Event:
        """Refuse new requests for `name` from now on -> an event set once those running have ended
        (at once where none runs); 404 for a name not loaded, or already being unloaded."""
        if name == self.base or name not in self.names or self.names[name].unloading is not None:
            raise APIError(404, f"no adapter named {name!r} is loaded", "invalid_request_error", "lora_name",
                           "lora_not_found")
        named = self.names[name]
        named.unloading = asyncio.Event()
        if not named.running:
            named.unloading.set()
        return named.unloading

    def cards(self, created: int) -> list[dict]:
        """The /v1/models entries: the base model, then each adapter with the base as its parent."""
        base = {"id": self.base, "object": "model", "created": created, "owned_by": "gptoss-jax", "root": self.base,
                "parent": None}
        return [base] + [{"id": n, "object": "model", "created": self.names[n].created, "owned_by": "gptoss-jax",
                          "root": self.names[n].path, "parent": self.base} for n in self.serving()]


def install(app, server, check) -> None:
    """The load and unload endpoints (vLLM's), behind the server's key (`check`)."""
    from ..training.adapter_files import AdapterError, read_adapter  # (the model's modules: loaded by now)

    import jax

    served = server.adapters

    async def parsed(http, model):
        check(http)
        raw = await body.read(http, server.limits.max_body_bytes, server.limits.read_timeout)
        if jax.process_count() > 1:  # the other processes' tables would not follow
            raise APIError(400, "adapters are loaded and unloaded while serving on one process only; with several, "
                                "give them at start (gptoss-serve --lora)", "invalid_request_error", None,
                           "unsupported_with_several_processes")
        return await server.prepare(body.parse, raw, model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(http: HTTPRequest):
        req = await parsed(http, protocol.LoadLoraRequest)
        entry = served.free_entry(req.lora_name)
        try:
            def put():  # read and put on a worker: the folder's tensors, the table's entry on the devices
                try:
                    adapter = read_adapter(req.lora_path, server.engine.config, max_rank=served.max_rank)
                    server.engine.put_adapter(entry, adapter.weights)
                except AdapterError as e:
                    raise bad_request(str(e), "lora_path", "invalid_lora_adapter") from None
                except ValueError as e:  # (one the table cannot hold: a target or rank beyond it)
                    raise bad_request(f"{req.lora_path}: {e}", "lora_path", "invalid_lora_adapter") from None
                return adapter.path

            path = await server.prepare(put)
        finally:
            served.loading.pop(req.lora_name)
        served.names[req.lora_name] = Named(entry, path, int(time.time()))
        return {"object": "lora_adapter", "id": req.lora_name, "parent": served.base, "root": path}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(http: HTTPRequest):
        req = await parsed(http, protocol.UnloadLoraRequest)
        await served.unloading(req.lora_name).wait()
        try:  # (zeros: nothing of it stays; a later load overwrites the whole entry anyway)
            await server.prepare(server.engine.put_adapter, served.names[req.lora_name].entry, None)
        finally:
            del served.names[req.lora_name]
        return {"object": "lora_adapter", "id": req.lora_name, "deleted": True}

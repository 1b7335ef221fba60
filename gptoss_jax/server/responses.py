"""The Responses API's objects and streaming events, built from a reply as it streams
(harmony.ReplyStream's deltas): a `reasoning` item, a `message` item with the answer, and a
`function_call` item per tool call, in the order the model wrote them. When `max_output_tokens`
cuts the reply, the response is "incomplete", and so is the item it cut (a tool call's arguments
cut short included); the items written whole before it are "completed"."""

from __future__ import annotations

import secrets
import time

from .harmony import Delta, ReplyStream


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


_ITEM_OF = {"reasoning": "reasoning", "content": "message", "tool_call": "function_call"}  # a piece's item
FORMAT_FIELDS = ("type", "name", "description", "schema", "strict")  # what a response echoes of text.format


def _format(fmt: dict | None) -> dict:
    """text.format as a response echoes it: the fields the API defines, nothing else a client sent."""
    return {k: v for k, v in (fmt or {"type": "text"}).items() if k in FORMAT_FIELDS}


class ResponseBuilder:
    def __init__(self, request, model: str, generation, response_id: str | None = None):
        self.request, self.model, self.generation = request, model, generation
        self.id, self.created = response_id or _id("resp"), int(time.time())
        self.items: list[dict] = []  # finished output items
        self._item: dict | None = None  # the item being streamed
        self._seq = 0
        self.final: dict | None = None  # the finished response object (`end` or `response`)

    # Streaming ---------------------------------------------------------------------------------------------

    def _ev(self, kind: str, **data) -> tuple[str, dict]:
        self._seq += 1
        return kind, {"sequence_number": self._seq - 1, **data}

    def start(self) -> list[tuple[str, dict]]:
        snapshot = self._response("in_progress", [], None)
        return [self._ev("response.created", response=snapshot), self._ev("response.in_progress", response=snapshot)]

    def delta(self, d: Delta, logprobs: list[dict] = ()) -> list[tuple[str, dict]]:
        """A piece's events; `logprobs`: the entries of the tokens that gave a text piece (server/logprobs.py)."""
        out = []
        kind = _ITEM_OF[d.kind]
        if self._item is None or self._item["type"] != kind or (d.kind == "tool_call" and d.id is not None):
            out += self._close()
            out += self._open(kind, d)
        item, index = self._item, len(self.items)
        if kind == "reasoning":
            item["content"][0]["text"] += d.text
            out.append(self._ev("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=d.text))
        elif kind == "message":
            item["content"][0]["text"] += d.text
            item["content"][0]["logprobs"] += logprobs
            out.append(self._ev("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=d.text, logprobs=list(logprobs)))
        elif d.text:
            item["arguments"] += d.text
            out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=d.text))
        return out

    def _open(self, kind: str, d: Delta) -> list[tuple[str, dict]]:
        index = len(self.items)
        if kind == "function_call":
            self._item = {"type": "function_call", "id": _id("fc"), "call_id": d.id, "name": d.name, "arguments": "",
                          "status": "in_progress"}
            return [self._ev("response.output_item.added", output_index=index, item=dict(self._item))]
        if kind == "reasoning":
            self._item = {"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                          "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            self._item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                          "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        empty = {**self._item, "content": []}
        part = {**self._item["content"][0], "text": ""}
        return [self._ev("response.output_item.added", output_index=index, item=empty),
                self._ev("response.content_part.added", item_id=self._item["id"], output_index=index, content_index=0,
                         part=part)]

    def _close(self, status: str = "completed") -> list[tuple[str, dict]]:
        item, index, out = self._item, len(self.items), []
        if item is None:
            return out
        item["status"] = status
        if item["type"] == "function_call":
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            out.append(self._ev(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"]))
            out.append(self._ev("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part))
        out.append(self._ev("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        self._item = None
        return out

    def end(self, reply: ReplyStream) -> list[tuple[str, dict]]:
        status = self._status()
        cut = self._item is not None and self._item["type"] == self._cut_item(status, reply)
        out = self._close("incomplete" if cut else "completed")
        final = self.final = self._response(status, self.items, reply)
        return out + [self._ev("response.completed" if status == "completed" else "response.incomplete",
                               response=final)]

    def fail(self, error) -> list[tuple[str, dict]]:
        """A stream's end when generating failed (error: errors.APIError, the request's own fault or the
        server's): an `error` event, then `response.failed` with what was made so far."""
        failed = self._response("failed", self.items, None)
        code = error.code or error.type
        failed["error"] = {"code": code, "message": error.message}
        return [self._ev("error", code=code, message=error.message, param=error.param),
                self._ev("response.failed", response=failed)]

    # Whole -------------------------------------------------------------------------------------------------

    def response(self, reply: ReplyStream, logprobs: list[dict] = ()) -> dict:
        """The whole response; `logprobs`: the answer's tokens' entries (server/logprobs.py)."""
        items = []
        if reply.reasoning:
            items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                          "content": [{"type": "reasoning_text", "text": "".join(reply.reasoning)}]})
        if reply.content or not reply.tool_calls:
            items.append({"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": "".join(reply.content), "annotations": [],
                                       "logprobs": list(logprobs)}]})
        for call in reply.tool_calls:
            items.append({"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name,
                          "arguments": call.arguments, "status": "completed"})
        status = self._status()
        cut = self._cut_item(status, reply)
        last = max((i for i, item in enumerate(items) if item["type"] == cut), default=None)
        if last is not None:
            items[last]["status"] = "incomplete"
        self.final = self._response(status, items, reply)
        return self.final

    def queued(self) -> dict:
        """A background response as it is answered at once: queued, no output yet."""
        return self._response("queued", [], None)

    def _status(self) -> str:
        if self.generation.cancelled:
            return "cancelled"
        cut = self.generation.was_cut or self.generation.request.finish_reason == "length"
        return "incomplete" if cut else "completed"

    @staticmethod
    def _cut_item(status: str, reply: ReplyStream) -> str | None:
        """The type of the item the reply was cut in, if it was cut inside one."""
        return _ITEM_OF.get(reply.unfinished) if status == "incomplete" else None

    def _response(self, status: str, output: list[dict], reply: ReplyStream | None) -> dict:
        r = self.request
        usage = None
        if reply is not None:
            u = self.generation.usage()
            usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                     "output_tokens": u["completion_tokens"],
                     "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
                     "total_tokens": u["total_tokens"]}
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  "strict": t.strict} for t in r.tools or []]
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": 1.0 if r.temperature is None else r.temperature,
                "top_p": 1.0 if r.top_p is None else r.top_p, "tools": tools,
                "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else "auto",
                "parallel_tool_calls": False, "reasoning": {"effort": (r.reasoning.effort if r.reasoning else None)
                                                            or "medium", "summary": None},
                "text": {"format": _format(r.text.format if r.text else None)},
                "metadata": {}, "previous_response_id": r.previous_response_id, "store": r.store,
                "background": r.background}

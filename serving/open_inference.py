"""The Open Inference Protocol (KServe v2) routes of ``mariana serve``: server and model health, readiness
and metadata (tensor names, datatypes, shapes; -1 = any size) and ``POST /v2/models/{name}/infer`` for each
app that declared its tensors (`AppContext.open_inference`), whose ``infer`` is its /v1 route's code path:
these routes translate tensors, nothing more. Tensors travel as JSON, or in Triton's binary tensor data
extension (tritonclient's default): ``JSON header + raw tensors``, the header's length in the
``Inference-Header-Content-Length`` header, each binary tensor's size in its ``binary_data_size`` parameter
(BYTES elements: a 4-byte little-endian length, then the bytes); outputs are binary when the request asks
(``binary_data_output``, or ``binary_data`` on an output). Errors: ``{"error": "..."}``, 400 or 404.
"""

import json
import struct
from functools import partial

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from mariana.platform.core.errors import MarianaError

from .batcher import Overloaded
from .context import AppContext, RequestError, error

HEADER = "inference-header-content-length"
NUMPY = {"FP32": "<f4", "FP64": "<f8", "INT32": "<i4", "INT64": "<i8", "BOOL": "?", "BYTES": object}


ProtocolError = partial(RequestError, 400)  # the request does not follow the protocol


def unpack_bytes(raw: bytes, where: str) -> list[bytes]:
    """Triton's serialized BYTES tensor -> its elements."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw) or i + 4 + (n := struct.unpack_from("<I", raw, i)[0]) > len(raw):
            raise ProtocolError(f"{where}: BYTES data truncated at byte {i} of {len(raw)}")
        out.append(raw[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def _flat(data) -> list:
    return [y for x in data for y in _flat(x)] if isinstance(data, list) else [data]


def read_request(body: bytes, header_len: str | None) -> tuple[dict, dict[str, list]]:
    """The request body -> (its JSON, each input's elements as a flat list; BYTES elements as bytes)."""
    n = len(body) if header_len is None else int(header_len) if header_len.isdigit() else -1
    if not 0 <= n <= len(body):
        raise ProtocolError(f"Inference-Header-Content-Length: expected 0..{len(body)} (got {header_len})")
    try:
        req = json.loads(body[:n])
    except ValueError as e:
        raise ProtocolError(f"request header: not JSON ({e})") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise ProtocolError('request: expected a JSON object with an "inputs" list')
    tensors, offset = {}, n
    for i, t in enumerate(req["inputs"]):
        where = f"inputs[{i}]"
        t = t if isinstance(t, dict) else {}
        shape, size = t.get("shape"), (t.get("parameters") or {}).get("binary_data_size")
        if not isinstance(shape, list) or not _counts(*shape, size or 0) or t.get("datatype") not in NUMPY:
            raise ProtocolError(
                f"{where}: expected a name, a shape of counts and a datatype of {', '.join(NUMPY)}"
            )
        if size is not None:
            raw, offset = body[offset : offset + size], offset + size
            if len(raw) != size:
                raise ProtocolError(f"{where}: binary_data_size {size} runs past the body's end")
            is_bytes = t["datatype"] == "BYTES"
            data = unpack_bytes(raw, where) if is_bytes else np.frombuffer(raw, NUMPY[t["datatype"]]).tolist()
        else:
            data = [x.encode() if isinstance(x, str) else x for x in _flat(t.get("data", []))]
        if not data:
            raise ProtocolError(f"{where}: no elements (shape {shape})")
        if len(data) != (n := int(np.prod(shape))):
            raise ProtocolError(f"{where}: shape {shape} needs {n} elements, the data has {len(data)}")
        tensors[str(t.get("name"))] = data
    return req, tensors


def _counts(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _check_inputs(req: dict, declared) -> None:
    """The request's inputs are the model's: the same names, each with its datatype."""
    got = {str(t.get("name")): t["datatype"] for t in req["inputs"]}
    if got != (want := {name: dtype for name, dtype, _ in declared}):
        raise ProtocolError(f"inputs: expected {want} (got {got})")


def write_response(name: str, version: str, req: dict, outputs: dict[str, list], declared) -> Response:
    """The outputs (``{name: nested list}``, typed as ``declared``) as the protocol's answer to ``req``."""
    outs = [o for o in req.get("outputs") or [] if isinstance(o, dict)]
    asked = {o.get("name"): o.get("parameters") or {} for o in outs}
    if unknown := set(asked) - set(outputs):
        raise ProtocolError(f"outputs: no output named {sorted(unknown)} (outputs: {sorted(outputs)})")
    default = bool((req.get("parameters") or {}).get("binary_data_output", False))
    head, chunks = [], []
    for out, dtype, _ in declared:
        if asked and out not in asked:
            continue
        arr = np.asarray(outputs[out], dtype=NUMPY[dtype])
        t = {"name": out, "datatype": dtype, "shape": list(arr.shape)}
        if asked.get(out, {}).get("binary_data", default):
            flat = [x.encode() if isinstance(x, str) else x for x in arr.reshape(-1)]
            raw = arr.tobytes() if dtype != "BYTES" else b"".join(struct.pack("<I", len(x)) + x for x in flat)
            t["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            t["data"] = arr.reshape(-1).tolist()
        head.append(t)
    ident = {"id": req["id"]} if "id" in req else {}
    body = {"model_name": name, "model_version": version, "outputs": head, **ident}
    if not chunks:
        return JSONResponse(body)
    header = json.dumps(body).encode()
    hdr = {"Inference-Header-Content-Length": str(len(header))}
    return Response(b"".join([header, *chunks]), media_type="application/octet-stream", headers=hdr)


def router(contexts: dict[str, AppContext]) -> APIRouter:
    """The ``/v2`` routes over the apps' contexts (those with ``ctx.v2``)."""
    r = APIRouter(tags=["open inference protocol (KServe v2)"])

    def served(name: str) -> AppContext:
        ctx = contexts.get(name)
        if ctx is None or ctx.v2 is None:
            names = ", ".join(a for a, c in contexts.items() if c.v2 is not None)
            raise RequestError(404, f"no model named {name!r} (models: {names})")
        if not ctx.served:
            raise RequestError(404, f"{name} is not served here (start the server with --{name} RUN)")
        return ctx

    @r.get("/v2", summary="server metadata")
    async def server_metadata() -> dict:
        return {"name": "mariana", "version": "1.0", "extensions": ["binary_tensor_data"]}

    @r.get("/v2/health/live", summary="the server is up")
    @r.get("/v2/health/ready", summary="the server is ready: its models are loaded before it listens")
    async def health(request: Request) -> dict:
        return {request.url.path.rsplit("/", 1)[1]: True}

    @r.get("/v2/models/{name}", summary="a model's tensors: names, datatypes, shapes (-1: any size)")
    async def metadata(name: str) -> dict:
        ctx = served(name)
        ins, outs = ([{"name": n, "datatype": d, "shape": s} for n, d, s in t] for t in ctx.v2[1:3])
        version = ctx.slot.current.version
        return {"name": name, "versions": [version], "platform": "pytorch", "inputs": ins, "outputs": outs}

    @r.get("/v2/models/{name}/ready", summary="the model is served")
    async def model_ready(name: str) -> dict:
        return {"name": served(name).app, "ready": True}

    @r.post("/v2/models/{name}/infer", summary="inference: JSON tensors or Triton's binary tensor data")
    async def infer(name: str, request: Request) -> Response:
        path, inputs, outputs, fn = (ctx := served(name)).v2
        try:
            req, tensors = read_request(await request.body(), request.headers.get(HEADER))
            _check_inputs(req, inputs)
            if (b := ctx.batchers.get(path)) is not None:
                b.arrived(request.scope)  # parsed: the micro-batcher no longer waits for this request
            result, version = await fn(tensors, req.get("parameters") or {})
            return write_response(name, version, req, result, outputs)
        except Overloaded:
            raise  # 429, as on /v1
        except MarianaError as e:  # the app's 415/422 are a protocol's 400
            return error(400, str(e))

    return r

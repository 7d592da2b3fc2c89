"""REST routes of the pCTR app, mounted by ``mariana serve`` through the app's spec (`spec.py`).

``POST /v1/pctr/predict`` ``{"instances": [LINE | {field: value}, ...]}`` ->
``{"probabilities": [p | null, ...], "errors": [{"index": i, "error": msg}], "model_version": v}``.
Requests are micro-batched across clients onto the model's inference thread; an instance that cannot be
scored is reported by index and never fails the others. A request whose every instance is invalid is a 422.

Module-level imports are FastAPI/pydantic only: a server without a pCTR model never imports the model code.
(No ``from __future__ import annotations`` here: FastAPI reads the request model from the route's annotation.)
"""

import json
import logging
import math
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from mariana.platform.core.errors import MarianaError
from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model

from .models.predict import load_predictor

log = logging.getLogger("mariana.serving")

PATH = "/v1/pctr/predict"
Instance = StrictStr | dict[str, Any]


class PctrResponse(BaseModel):
    probabilities: list[float | None] = Field(description="click probability per instance; null if invalid")
    errors: list[dict[str, Any]] = Field(description='[{"index": i, "error": message}] for invalid instances')
    model_version: str


# ------------------------------------------------------------------------------------------ loading
def load_for_serving(run_dir: str):
    """`load_predictor` plus one warm-up prediction (the app's serving loader, see `spec.py`)."""
    pred = load_predictor(run_dir)
    warm_up(pred)
    return pred


def warm_up(pred) -> None:
    """One tiny prediction so the first real request does not pay for lazy initialisation. The warm-up
    record is the model's own format with every field missing; parse errors are fine (nothing to warm)."""
    line = "\t" * 38 if getattr(pred, "format", "libfm") == "criteo" else "0:1"
    try:
        probs, _ = pred.predict_lines([line])
    except Exception:  # noqa: BLE001  -- a record the model rejects warms nothing; not a load failure
        log.debug("pctr warm-up skipped", exc_info=True)
        return
    for p in probs:
        if p is not None and not math.isfinite(float(p)):
            raise MarianaError(f"model answers a non-finite probability ({p}) for a warm-up record")


# ------------------------------------------------------------------------------------------ scoring
def score_batch(slot, items: list) -> tuple[list, str]:
    """Inference thread: parse + predict a micro-batch of instances (strings and/or dicts) with the model
    current at this moment. Returns one float (probability) or str (error) per item, and the version."""
    loaded = slot.current  # this batch finishes on this version even if a reload lands
    try:
        return score(loaded.obj, items), loaded.version
    except Exception as e:  # noqa: BLE001
        if len(items) == 1:
            log.warning("pctr: instance rejected: %s: %s", type(e).__name__, e)
            return [f"instance could not be scored ({type(e).__name__}: {e})"], loaded.version
    # The predictor raised instead of reporting per-instance errors: score one by one so one bad
    # instance cannot fail the other requests of its micro-batch (slow path, only after a failure).
    log.warning("pctr: batch of %d raised; scoring instances one by one", len(items))
    out = []
    for x in items:
        try:
            out += score(loaded.obj, [x])
        except Exception as e:  # noqa: BLE001
            out.append(f"instance could not be scored ({type(e).__name__}: {e})")
    return out, loaded.version


def score(pred, items: list) -> list:
    import torch

    out: list = [None] * len(items)
    lines_idx = [i for i, x in enumerate(items) if isinstance(x, str)]
    json_idx = [i for i, x in enumerate(items) if not isinstance(x, str)]
    with torch.inference_mode():
        if lines_idx:
            lines = items if len(lines_idx) == len(items) else [items[i] for i in lines_idx]
            probs, errors = pred.predict_lines(lines)
            _scatter(out, lines_idx, probs, errors)
        if json_idx:
            if not callable(getattr(pred, "parse_json", None)):
                for i in json_idx:
                    out[i] = "this model accepts only text records (its training format)"
            else:
                batch, errors = pred.parse_json([items[i] for i in json_idx])
                valid = [j for j in range(len(json_idx)) if j not in errors]
                probs: list = [None] * len(json_idx)
                if valid:
                    p = pred.predict(batch)
                    for j, v in zip(valid, p.tolist() if hasattr(p, "tolist") else list(p)):
                        probs[j] = v
                _scatter(out, json_idx, probs, errors)
    return out


def _scatter(out: list, idx: list[int], probs, errors: dict) -> None:
    for j, i in enumerate(idx):
        if j in errors:
            out[i] = str(errors[j])
        elif probs[j] is None:
            out[i] = "instance could not be scored"
        elif not math.isfinite(p := float(probs[j])):  # NaN/inf feature values: not valid JSON either
            out[i] = f"instance has non-finite feature values (probability {p})"
        else:
            out[i] = p


# ------------------------------------------------------------------------------------------- routes
def router(ctx) -> APIRouter:
    """The pCTR routes for ``ctx`` (a `mariana.serving.context.AppContext`)."""
    r = APIRouter(tags=["pctr"])
    ctx.json_body(PATH)
    batcher = ctx.micro_batcher(PATH, lambda items: score_batch(ctx.slot, items)) if ctx.served else None
    instances = ctx.metrics.instances

    async def predict(items: list) -> tuple[list, list, str]:
        """Both routes' scoring, micro-batched, counted: (probability | None, [{"index", "error"}], version)."""
        results, version = await batcher.submit(items)
        probs = [r if isinstance(r, float) else None for r in results]
        errors = [{"index": i, "error": r} for i, r in enumerate(results) if not isinstance(r, float)]
        instances.labels("pctr", "ok").inc(len(results) - len(errors))
        if errors:
            instances.labels("pctr", "error").inc(len(errors))
        return probs, errors, version

    async def v2_infer(tensors: dict, parameters: dict) -> tuple[dict, str]:
        """Open Inference: BYTES ``lines`` (/v1's instances) -> FP32 ``probabilities``; no invalid line."""
        lines = [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in tensors["lines"]]
        probs, errors, version = await predict(lines)
        if errors:
            raise MarianaError(f"lines[{errors[0]['index']}]: {errors[0]['error']} ({len(errors)} invalid)")
        return {"probabilities": probs}, version

    ctx.open_inference(PATH, (("lines", "BYTES", [-1]),), (("probabilities", "FP32", [-1]),), v2_infer)
    req_model = create_model(
        "PctrRequest",
        __config__=ConfigDict(extra="forbid"),
        instances=(
            Annotated[
                list[Instance],
                Field(
                    min_length=1,
                    max_length=ctx.cfg.max_instances,
                    description="records in the model's training format without the label (a Criteo "
                    "TSV line or a libFM 'id:value ...' line), or structured {field: value} objects",
                ),
            ],
            ...,
        ),
    )

    @r.post(
        PATH,
        response_model=PctrResponse,
        summary="click probabilities for a batch of records",
        responses={
            404: {"description": "no pCTR model served"},
            422: {"description": "invalid request, or no valid instance"},
        },
    )
    async def pctr_predict(body: req_model, request: Request) -> Response:  # type: ignore[valid-type]
        if batcher is None:
            return ctx.not_served()
        batcher.arrived(request.scope)
        probs, errors, version = await predict(body.instances)
        payload = {"probabilities": probs, "errors": errors, "model_version": version}
        if len(errors) == len(probs):
            payload["error"] = f"no valid instance: instance 0: {errors[0]['error']}"
            return Response(json.dumps(payload), status_code=422, media_type="application/json")
        # Serialised directly: jsonable_encoder on 10k floats costs more than the model.
        return Response(json.dumps(payload), media_type="application/json")

    return r

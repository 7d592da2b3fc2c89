"""REST routes of the vision app, mounted by ``mariana serve`` through the app's spec (`spec.py`).

``POST /v1/vision/classify?k=5`` multipart ``file`` = JPEG/PNG/GIF ->
``{"labels": [{"label", "probability"}, ...], "model_version": v, "tta": bool, "tta_mode": m}``;
``?tta=true|flip|crops`` averages the probabilities of views of the image (`fast_recipe.tta_views`).

Imported only when vision routes are mounted (`AppSpec.router`).
"""

import logging

from fastapi import APIRouter, File, Query, UploadFile
from mariana.platform.core.errors import MarianaError
from mariana.serving.context import error

from .fast_recipe import tta_mode

log = logging.getLogger("mariana.serving")

PATH = "/v1/vision/classify"
IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")


def is_image(data: bytes) -> bool:
    return any(data.startswith(m) for m in IMAGE_MAGIC)


def router(ctx) -> APIRouter:
    """The vision routes for ``ctx`` (a `mariana.serving.context.AppContext`)."""
    r = APIRouter(tags=["vision"])
    ctx.upload_body(PATH)

    @r.post(
        PATH,
        summary="top-k labels for a JPEG/PNG upload (multipart field 'file')",
        responses={404: {"description": "no vision model served"}, 415: {"description": "not an image"}},
    )
    async def vision_classify(
        file: UploadFile = File(..., description="JPEG or PNG image"),
        k: int = Query(5, ge=1, le=100, description="how many labels"),
        tta: str = Query(
            "false",
            pattern="^(true|false|1|0|none|flip|crops)$",
            description="test-time augmentation: true/flip = mean of the image's and its mirror's "
            "probabilities; crops = mean over 6 views (flip + 1 px translations)",
        ),
    ) -> dict:
        if not ctx.served:
            return ctx.not_served()
        data = await file.read()
        if not data:
            return error(422, "file: empty upload")
        if not is_image(data):
            return error(415, "file: not a JPEG/PNG/GIF image")
        loaded = ctx.slot.current
        mode = tta_mode(tta)
        try:
            top = await ctx.run(loaded.obj.classify_bytes, data, k, mode)
        except MarianaError as e:
            return error(422, f"file: {e}")
        except Exception as e:  # noqa: BLE001  -- a corrupt image must not become a 500
            log.warning("vision: upload rejected: %s: %s", type(e).__name__, e)
            return error(422, f"file: image could not be decoded ({type(e).__name__}: {e})")
        return {
            "labels": [{"label": lbl, "probability": float(p)} for lbl, p in top],
            "model_version": loaded.version,
            "tta": mode != "none",
            "tta_mode": mode,
        }

    return r

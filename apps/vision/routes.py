"""REST routes of the vision app, mounted by ``mariana serve`` through the app's spec (`spec.py`).

``POST /v1/vision/classify?k=5`` multipart ``file`` = JPEG/PNG/GIF ->
``{"labels": [{"label", "probability"}, ...], "model_version": v, "tta": bool, "tta_mode": m}``;
``?tta=true|flip|crops`` averages the probabilities of views of the image (`fast_recipe.tta_views`).
"""

from fastapi import APIRouter, File, Query, UploadFile
from mariana.serving.context import RequestError

from .data import image_bytes_ok
from .fast_recipe import tta_mode

PATH = "/v1/vision/classify"
TTA_VALUES = ("true", "false", "1", "0", "none", "flip", "crops")


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
            pattern=f"^({'|'.join(TTA_VALUES)})$",
            description="test-time augmentation: true/flip = mean of the image's and its mirror's "
            "probabilities; crops = mean over 6 views (flip + 1 px translations)",
        ),
    ) -> dict:
        if not ctx.served:
            return ctx.not_served()
        return await classify(await file.read(), k, tta, "file")

    async def classify(data: bytes, k: int, tta: str, field: str) -> dict:
        """Both routes' top-k of one encoded image; RequestError (4xx) naming ``field`` when it is none."""
        mode = tta_mode(tta)
        what = "a JPEG/PNG/GIF image"
        top, version = await ctx.on_upload("classify_bytes", data, field, image_bytes_ok(data), what, k, mode)
        return {
            "labels": [{"label": lbl, "probability": float(p)} for lbl, p in top],
            "model_version": version,
            "tta": mode != "none",
            "tta_mode": mode,
        }

    async def v2_infer(tensors: dict, parameters: dict) -> tuple[dict, str]:
        """Open Inference: BYTES ``image`` (encoded images) -> ``labels`` (BYTES) and ``probabilities`` (FP32),
        both [images, k]; parameters ``k`` (default 5) and ``tta`` as /v1's query."""
        k, tta = parameters.get("k", 5), str(parameters.get("tta", "false")).lower()
        if not isinstance(k, int) or not 1 <= k <= 100 or tta not in TTA_VALUES:
            raise RequestError(
                400, f"parameters: expected k 1..100, tta one of {TTA_VALUES} (got {k}, {tta})"
            )
        tops = [await classify(x, k, tta, f"image[{i}]") for i, x in enumerate(tensors["image"])]
        labels, probs = (
            [[t[key] for t in top["labels"]] for top in tops] for key in ("label", "probability")
        )
        return {"labels": labels, "probabilities": probs}, tops[0]["model_version"]

    outputs = (("labels", "BYTES", [-1, -1]), ("probabilities", "FP32", [-1, -1]))
    ctx.open_inference(PATH, (("image", "BYTES", [-1]),), outputs, v2_infer)
    return r

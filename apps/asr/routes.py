"""REST routes of the ASR app, mounted by ``mariana serve`` through the app's spec (`spec.py`).

``POST /v1/asr/transcribe`` multipart ``file`` = WAV -> ``{"transcript": str, "model_version": v}``.

Module-level imports are FastAPI only: a server without an ASR model never imports the model code.
"""

import logging

from fastapi import APIRouter, File, UploadFile
from mariana.platform.core.errors import MarianaError
from mariana.serving.context import OpenInference, RequestError

from .data import AUDIO_FORMATS

log = logging.getLogger("mariana.serving")

PATH = "/v1/asr/transcribe"
WAV_MAGIC = (b"RIFF", b"RIFX", b"RF64")


def is_wav(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] in WAV_MAGIC and data[8:12] == b"WAVE"


def is_audio(data: bytes) -> bool:
    """The containers `data.read_wav` decodes (AUDIO_FORMATS), as `mariana asr transcribe` takes them:
    WAV, FLAC (``fLaC``) and Ogg (``OggS``)."""
    return is_wav(data) or data[:4] in (b"fLaC", b"OggS")


def router(ctx) -> APIRouter:
    """The ASR routes for ``ctx`` (a `mariana.serving.context.AppContext`)."""
    r = APIRouter(tags=["asr"])
    ctx.upload_body(PATH)

    @r.post(
        PATH,
        summary=f"transcribe a {AUDIO_FORMATS} upload (multipart field 'file')",
        responses={404: {"description": "no ASR model served"}, 415: {"description": f"not {AUDIO_FORMATS}"}},
    )
    async def asr_transcribe(file: UploadFile = File(..., description=f"{AUDIO_FORMATS} audio")) -> dict:
        if not ctx.served:
            return ctx.not_served()
        return await transcribe(await file.read(), "file")

    async def transcribe(data: bytes, field: str) -> dict:
        """Both routes' transcript of one audio file; RequestError (4xx) naming ``field`` when it is none."""
        if not data:
            raise RequestError(422, f"{field}: empty upload")
        if not is_audio(data):
            raise RequestError(
                415, f"{field}: not a {AUDIO_FORMATS} file (expected a RIFF/WAVE, fLaC or OggS header)"
            )
        loaded = ctx.slot.current
        try:
            text = await ctx.run(loaded.obj.transcribe_wav_bytes, data)
        except MarianaError as e:
            raise RequestError(422, f"{field}: {e}") from None
        except Exception as e:  # noqa: BLE001  -- undecodable audio must not become a 500
            # The detail goes to the server log; the client gets a plain message, not an internal one.
            log.warning("asr: upload rejected: %s: %s", type(e).__name__, e)
            raise RequestError(
                422, f"{field}: audio could not be decoded or transcribed (expected a {AUDIO_FORMATS} file)"
            ) from None
        return {"transcript": text, "model_version": loaded.version}

    async def v2_infer(tensors: dict, parameters: dict) -> tuple[dict, str]:
        """Open Inference: BYTES ``audio`` (encoded files) -> BYTES ``transcript``, one per file."""
        answers = [await transcribe(x, f"audio[{i}]") for i, x in enumerate(tensors["audio"])]
        version = answers[0]["model_version"] if answers else ctx.slot.current.version
        return {"transcript": [a["transcript"] for a in answers]}, version

    ctx.v2 = OpenInference(PATH, (("audio", "BYTES", [-1]),), (("transcript", "BYTES", [-1]),), v2_infer)
    return r

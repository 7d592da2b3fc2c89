"""REST routes of the ASR app, mounted by ``mariana serve`` through the app's spec (`spec.py`).

``POST /v1/asr/transcribe`` multipart ``file`` = WAV -> ``{"transcript": str, "model_version": v}``.

Module-level imports are FastAPI only: a server without an ASR model never imports the model code.
"""

from fastapi import APIRouter, File, UploadFile

from .data import AUDIO_FORMATS

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
        what = f"a {AUDIO_FORMATS} file (a RIFF/WAVE, fLaC or OggS header)"
        text, version = await ctx.on_upload("transcribe_wav_bytes", data, field, is_audio(data), what)
        return {"transcript": text, "model_version": version}

    async def v2_infer(tensors: dict, parameters: dict) -> tuple[dict, str]:
        """Open Inference: BYTES ``audio`` (encoded files) -> BYTES ``transcript``, one per file."""
        answers = [await transcribe(x, f"audio[{i}]") for i, x in enumerate(tensors["audio"])]
        return {"transcript": [a["transcript"] for a in answers]}, answers[0]["model_version"]

    ctx.open_inference(PATH, (("audio", "BYTES", [-1]),), (("transcript", "BYTES", [-1]),), v2_infer)
    return r

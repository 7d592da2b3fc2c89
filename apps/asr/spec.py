"""The ASR app as the platform sees it (`mariana.platform.core.registry`); standard library imports only."""

from mariana.platform.core.registry import AppSpec, TuneInfo

SPEC = AppSpec(
    name="asr",
    cli="mariana.apps.asr.cli",
    loader="mariana.apps.asr.predict:load_transcriber",
    routes="mariana.apps.asr.routes:router",
    serve_help="ASR run directory -> POST /v1/asr/transcribe",
    requires=("transcribe_wav_bytes",),
    tune=TuneInfo("mariana.apps.asr.configs", "AsrConfig", "wer"),
    order=10,
)

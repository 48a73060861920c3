"""Whisper (models/whisper/whisper.walk): the node classes its plan names `mstar_models.whisper.<Class>`.

- LogMel (stateless): extract(audio) -> (mel, frames); the log-mel features (features.py)
- Encoder (stateless): encode(mel) -> states; convolutions, sinusoids, pre-LN layers (encoder.py)
- Prompt (stateless): build(language, task, timestamps, prompt) -> (head, language, tail) (prompt.py)
- Decoder (kv; tags text, cross, probe): listen / detect / prefill / step (decoder.py)
- Windows (stateless): start / cut / judge / advance; long-form seeking, the temperature
  fallback, the segments (windows.py)
- Transcript (stateless): finish(segments, lang) -> (text, language, segments);
  detokenize(tokens) -> text (prompt.py)
- Live (stateless): start / hear / note / settle; audio streamed in, the windows decoded as
  their audio arrives, checked against the whole audio's features at the end (live.py)
"""

from mstar_models.whisper.decoder import Decoder
from mstar_models.whisper.encoder import Encoder
from mstar_models.whisper.features import LogMel
from mstar_models.whisper.live import Live
from mstar_models.whisper.prompt import Prompt, Transcript
from mstar_models.whisper.windows import Windows

__all__ = ["Decoder", "Encoder", "Live", "LogMel", "Prompt", "Transcript", "Windows"]

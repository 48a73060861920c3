"""Whisper (models/whisper/whisper.walk): the node classes its plan names `mstar_models.whisper.<Class>`.

- LogMel (stateless): extract(audio) -> (mel, duration); the log-mel features (features.py)
- Encoder (stateless): encode(mel) -> states; convolutions, sinusoids, pre-LN layers (encoder.py)
- Prompt (stateless): build(language, task, timestamps, prompt) -> (head, language, tail) (prompt.py)
- Decoder (kv; tags text, cross, probe): listen / detect / prefill / step (decoder.py)
- Transcript (stateless): finish(tokens, last, lang, duration) -> (text, language, segments);
  detokenize(tokens) -> text (prompt.py)
"""

from mstar_models.whisper.decoder import Decoder
from mstar_models.whisper.encoder import Encoder
from mstar_models.whisper.features import LogMel
from mstar_models.whisper.prompt import Prompt, Transcript

__all__ = ["Decoder", "Encoder", "LogMel", "Prompt", "Transcript"]

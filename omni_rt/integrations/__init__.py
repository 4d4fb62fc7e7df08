"""In-process adapters for voice-agent frameworks, each an optional extra:

- `omni_rt.integrations.pipecat`: `OmniRtService`, a pipecat speech-to-speech service (`omni-rt[pipecat]`)
- `omni_rt.integrations.livekit`: `RealtimeModel`, a LiveKit Agents realtime model (`omni-rt[livekit]`)

Importing this package imports neither framework; importing a module imports its framework.
"""

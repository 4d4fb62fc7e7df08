"""What Smart Turn v3.2 answers at each pause of espeak-ng sentences, on this CPU, under onnxruntime's
graph settings: the figures docs/turn-taking.md quotes, for anyone to check on their own machine.

    python3 scripts/smart_turn_probe.py                 # the default sentence set
    python3 scripts/smart_turn_probe.py "Is it <break time=\"400ms\"/> raining?"

Each sentence (SSML allowed) is spoken by espeak-ng (tests/audio_clips.py), framed by silence, and run
through `SemanticVad` as a server runs it (the tests' `Recording` detector); every time the detector asks the model (at each pause Silero
finds, and after the last word) the answer is printed, once per session setting: "all" (what omni_rt
runs, as pipecat does: every graph optimisation, the quantised graph run as fused int8 kernels, which
differ by instruction set), "qdq-float" (the same graph with its quantise/dequantise pairs run in float),
"basic" and "none" (fewer graph rewrites). Needs espeak-ng and onnxruntime (`scripts/setup.sh test`).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from audio_clips import cat, silence, speech  # noqa: E402
from test_semantic_vad import Recording, run  # noqa: E402

from omni_rt.audio import semantic  # noqa: E402
from omni_rt.audio.onnx import packaged_file  # noqa: E402

BREAK = '<break time="400ms"/>'
MID_PHRASE = [  # a 400 ms break where the sentence is not finished
    f"And then we went to {BREAK} the store to buy some bread.",
    f"And then we went to the {BREAK} store to buy some bread.",
    f"I was thinking that maybe {BREAK} we could go tomorrow.",
    f"Could you tell me {BREAK} the way to the station?",
    f"My favourite kind of music is {BREAK} jazz from the fifties.",
    f"I would like to book a table {BREAK} for two at eight.",
    f"The meeting has been moved to {BREAK} Thursday afternoon.",
    f"When I was a child we used to {BREAK} play in the garden.",
]
FINISHED = [
    "What is the capital of France?",
    "Tell me about the weather in Paris.",
    "How are you today?",
    "Can you recommend a good book?",
    "I would like to book a table for two at eight tonight.",
]
SETTINGS = ("all", "qdq-float", "basic", "none")


def cpu_name() -> str:
    """The CPU's model name and whether it has VNNI (onnxruntime's int8 kernels differ by it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    return f"{name} ({'VNNI' if 'vnni' in info else 'no VNNI'})"


def session(kind: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    level = ort.GraphOptimizationLevel
    opts.graph_optimization_level = {"none": level.ORT_DISABLE_ALL, "basic": level.ORT_ENABLE_BASIC}.get(
        kind, level.ORT_ENABLE_ALL
    )
    if kind == "qdq-float":
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    path = str(packaged_file(*semantic.SmartTurn.FILE))
    return ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def answers(text: str, model: semantic.SmartTurn) -> list[float]:
    """The model's answer each time the detector asks, for `text` framed by silence."""

    def detector(cfg):  # the tests' recording detector, asking this session's model
        vad = Recording(cfg)
        vad._turn_model = model
        return vad

    _, vad = run(cat(silence(300), speech(text), silence(600)), detector=detector)
    return [round(p, 2) for _, p in vad.asked]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sentences", nargs="*", help="sentences to speak (SSML allowed); default: the set above")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    print(f"{cpu_name()}, onnxruntime {ort.__version__}")
    models = {}
    for kind in SETTINGS:
        m = semantic.SmartTurn.__new__(semantic.SmartTurn)
        m._session = session(kind)
        models[kind] = m
    sets = (
        [("given", args.sentences)]
        if args.sentences
        else [("mid-phrase", MID_PHRASE), ("finished", FINISHED)]
    )
    for label, texts in sets:
        for text in texts:
            cells = "  ".join(f"{k}: {answers(text, m)}" for k, m in models.items())
            print(f"{label:10} {text.replace(BREAK, '|')[:44]:44}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Set up a fresh machine for omni_rt from the package registries only.
#   scripts/setup.sh          the SDK and the WebRTC server (enough for `omni-rt serve`)
#   scripts/setup.sh test     also the test tools: transformers (the reference), Playwright, Chromium, ruff
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch 2.13.0 is pinned on its own first: an unpinned torch pulls a multi-GB CUDA build.
python3 -m pip install -q "torch==2.13.0"
if [ "${1:-}" = "test" ]; then
  python3 -m pip install -q -e ".[server,vad,bench,test]"
  # Debian's Chromium for the browser test (Playwright never downloads a browser here); espeak-ng speaks
  # the test utterances of the turn-taking and agent-framework tests.
  apt_packages=()
  command -v chromium >/dev/null 2>&1 || apt_packages+=(chromium)
  command -v espeak-ng >/dev/null 2>&1 || apt_packages+=(espeak-ng)
  if [ ${#apt_packages[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${apt_packages[@]}" >/dev/null
  fi
else
  python3 -m pip install -q -e ".[server,vad]"
fi
# Smart Turn v3 (semantic_vad) is the ONNX file inside pipecat-ai's wheel; nothing else of it is used.
python3 -m pip install -q --no-deps "pipecat-ai==1.14.0"

#!/usr/bin/env bash
# Run here (with network), in the repo root: fills .whl with what the GPU image lacks for `nox -s test-cuda` and the
# rounds (nox and its needs, the openai client the server tests use, gguf): 16 wheels, ~12 MB. The SmolLM2 GGUF
# (98 MB) and the ShareGPT text (126 MB) exceed the call's 64 MiB, so the tests that read them run on the CPU only.
# Everything else (torch, triton, cuda-bindings, tokenizers, transformers, aiohttp, pytest...) is in the image.
set -euo pipefail
mkdir -p .git/info && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
WHEELS=(nox argcomplete colorlog dependency-groups distlib virtualenv platformdirs
        openai distro jiter pydantic pydantic-core annotated-types typing-inspection sniffio gguf)
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls .whl

#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the peer in BENCHMARKS.md, from the llama.cpp that the
# llama-cpp-python sdist vendors (PyPI is the only registry these machines reach). Kept
# outside the repository and CI: ./benchmarks/build_llama_server.sh [DIR] (default
# /tmp/llamacpp), then pass DIR/build/bin/llama-server to served_speed.py --llama-server.
set -euo pipefail
dir=${1:-/tmp/llamacpp}
mkdir -p "$dir" && cd "$dir"
ls llama_cpp_python-*.tar.gz >/dev/null 2>&1 || pip download --no-deps --no-binary :all: llama-cpp-python -d .
[ -d "$(ls -d llama_cpp_python-*/ 2>/dev/null | head -1)" ] || tar xzf llama_cpp_python-*.tar.gz
src=$(ls -d llama_cpp_python-*/vendor/llama.cpp | head -1)
isa=(-DGGML_NATIVE=ON)
# ggml's native build dies with an illegal instruction on AMX CPUs: name the ISA without AMX.
if grep -qw amx_tile /proc/cpuinfo; then
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
       -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
fi
cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
cmake --build build --target llama-server -j "$(nproc)"
echo "$dir/build/bin/llama-server"

#!/usr/bin/env bash
# Install llama.cpp as prebuilt binaries, without compiling: npm's node-llama-cpp, whose
# optional package @node-llama-cpp/linux-x64 ships llama.cpp built for x86-64 CPUs (one ggml CPU
# backend per instruction set: haswell for AVX2, skylakex/zen4 for AVX-512, ...; chosen at load).
# Its own folder, never kvseal's dependencies; bench/peers/llama_cpp_node.mjs runs it
# (bench/quant.py --parts decode --llama node --llama-node-dir DIR).
#
# Usage: bench/peers/install_llama_cpp_node.sh [DIR]     (default: ~/.venvs/llamacpp-node)
# Env:   NODE_LLAMA_CPP_VERSION (default 3.21.1: its lock installs from the npm registry alone)
# Needs node >= 20 and npm. The package's postinstall (which may offer to build) is not needed:
# the runner asks for the prebuilt binary only (build: "never").
set -euo pipefail
DIR="${1:-$HOME/.venvs/llamacpp-node}"
VERSION="${NODE_LLAMA_CPP_VERSION:-3.21.1}"
mkdir -p "$DIR"
cd "$DIR"
[[ -f package.json ]] || npm init -y >/dev/null
npm install --save-exact --ignore-scripts "node-llama-cpp@$VERSION"
test -f node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/llama-addon.node \
  || { echo "no prebuilt llama.cpp for linux-x64 in $DIR" >&2; exit 1; }
node -e 'const m=require("./node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/_nlcBuildMetadata.json");
console.log("node-llama-cpp", process.argv[1], "llama.cpp", m.buildOptions.llamaCpp.repo + "@" + m.buildOptions.llamaCpp.release)' "$VERSION"
